'use strict';
// Load from Node.js for bench/publish.py, so that the client is not what limits the server:
//
//   node bench/publish_load.js rate ADDRESS publish|append CALLERS SECONDS [IN_FLIGHT]
//   node bench/publish_load.js latency ADDRESS publish|append RATE SECONDS
//
// `rate`: CALLERS Publish sessions (each keeping IN_FLIGHT one-entry messages unanswered) or
// CALLERS unary Append loops, each on its own connection, one 100-byte entry per message or
// call, for SECONDS after a one-second warm-up; prints {"calls_per_s", "p50_ms", "p99_ms"}
// (per message or call, send to answer). `latency`: one entry every 1/RATE s on an absolute
// schedule, its send time (process.hrtime) in its first 8 bytes, and a subscriber on another
// connection; prints {"p50_us", "p99_us", "received"} of append-to-subscriber latency.

const { Client, Publisher } = require('../clients/node');

const PAYLOAD = 100;
const LATENCY_IN_FLIGHT = 64;

function percentile(sorted, p) {
  if (!sorted.length) return 0;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

async function rate(address, mode, callers, seconds, inFlight) {
  const stream = `load-${mode}-${process.pid}`;
  const payload = Buffer.alloc(PAYLOAD, 120);
  const clients = Array.from({ length: callers }, () => new Client(address, { timeoutMs: 60000 }));
  await clients[0].append(stream, payload); // the stream exists before the clock starts
  let counting = false;
  let stop = false;
  let count = 0;
  const latencies = [];
  const done = (started) => {
    if (!counting) return;
    count += 1;
    if (latencies.length < 200000) latencies.push(Number(process.hrtime.bigint() - started) / 1e6);
  };
  const loops = clients.map(async (client) => {
    if (mode === 'append') {
      while (!stop) {
        const started = process.hrtime.bigint();
        await client.append(stream, payload);
        done(started);
      }
      return;
    }
    const publisher = new Publisher(client, { maxInFlight: inFlight });
    const pending = new Set();
    while (!stop) {
      const started = process.hrtime.bigint();
      const answer = publisher.publish(stream, payload).then(() => done(started));
      pending.add(answer);
      answer.finally(() => pending.delete(answer));
      if (pending.size >= inFlight) await Promise.race(pending);
    }
    await Promise.all(pending);
    await publisher.close();
  });
  await new Promise((resolve) => { setTimeout(resolve, 1000); });
  counting = true;
  const t0 = process.hrtime.bigint();
  await new Promise((resolve) => { setTimeout(resolve, seconds * 1000); });
  counting = false;
  const elapsed = Number(process.hrtime.bigint() - t0) / 1e9;
  stop = true;
  await Promise.all(loops);
  for (const client of clients) client.close();
  latencies.sort((a, b) => a - b);
  return {
    calls_per_s: count / elapsed, p50_ms: percentile(latencies, 50), p99_ms: percentile(latencies, 99),
  };
}

async function latency(address, mode, perSecond, seconds) {
  const stream = `latency-${mode}-${process.pid}`;
  const producer = new Client(address, { timeoutMs: 60000 });
  const reader = new Client(address, { timeoutMs: 60000 });
  await producer.append(stream, Buffer.alloc(PAYLOAD));
  const publisher = mode === 'publish' ? new Publisher(producer, { maxInFlight: LATENCY_IN_FLIGHT }) : null;
  const total = Math.floor(perSecond * seconds);
  const micros = [];
  const subscription = reader.subscribe(stream, { start: 'latest' });
  const received = (async () => {
    for await (const batch of subscription) {
      const now = process.hrtime.bigint();
      for (const entry of batch.entries) micros.push(Number(now - entry.payload.readBigUInt64LE(0)) / 1000);
      if (micros.length >= total) break;
    }
  })();
  await new Promise((resolve) => { setTimeout(resolve, 200); }); // the subscription is open
  const t0 = process.hrtime.bigint();
  const interval = BigInt(Math.round(1e9 / perSecond));
  const sends = [];
  const pending = new Set();
  for (let i = 0; i < total; i += 1) {
    const wait = Number(t0 + BigInt(i) * interval - process.hrtime.bigint()) / 1e6;
    if (wait > 0) await new Promise((resolve) => { setTimeout(resolve, wait); });
    const payload = Buffer.alloc(PAYLOAD, 120);
    payload.writeBigUInt64LE(process.hrtime.bigint(), 0);
    const sent = publisher ? publisher.publish(stream, payload) : producer.append(stream, payload);
    sends.push(sent);
    pending.add(sent);
    sent.finally(() => pending.delete(sent));
    // A server that falls behind the schedule delays it (and the figures show that), but is
    // never sent more than IN_FLIGHT calls at once (past max_concurrent_calls_per_connection).
    if (pending.size >= LATENCY_IN_FLIGHT) await Promise.race(pending);
  }
  await Promise.all(sends);
  await Promise.race([received, new Promise((resolve) => { setTimeout(resolve, 10000); })]);
  if (publisher) await publisher.close();
  producer.close();
  reader.close();
  micros.sort((a, b) => a - b);
  return { p50_us: percentile(micros, 50), p99_us: percentile(micros, 99), received: micros.length };
}

async function main() {
  const [command, address, mode, a, b, c] = process.argv.slice(2);
  const result = command === 'latency'
    ? await latency(address, mode, Number(a), Number(b))
    : await rate(address, mode, Number(a), Number(b), Number(c || 64));
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
