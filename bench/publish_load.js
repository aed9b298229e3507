'use strict';
// Load from Node.js for bench/publish.py, so that the client is not what limits the server:
//
//   node bench/publish_load.js rate ADDRESS publish|append CALLERS SECONDS [IN_FLIGHT]
//   node bench/publish_load.js latency ADDRESS publish|append RATE SECONDS
//   node bench/publish_load.js spread SEEDS publish|append STREAMS IN_FLIGHT SECONDS
//
// `rate`: CALLERS Publish sessions (each keeping IN_FLIGHT one-entry messages unanswered) or
// CALLERS unary Append loops, each on its own connection, one 100-byte entry per message or
// call, for SECONDS after a one-second warm-up; prints {"calls_per_s", "p50_ms", "p99_ms"}
// (per message or call, send to answer). `latency`: one entry every 1/RATE s on an absolute
// schedule, its send time (process.hrtime) in its first 8 bytes, and a subscriber (on the same
// connection: grpc-js shares one between clients of an address); prints {"p50_us", "p99_us",
// "received"} of append-to-subscriber latency and what this process spent meanwhile: its event
// loop's delay ("node_loop_delay_p99_us", "node_loop_delay_max_us"), its CPU per entry
// ("node_cpu_us_per_entry"), the time from each send to its call's answer ("node_answer_p50_us",
// "node_answer_p99_us": the call's own path, without the delivery to the subscriber) and, for `publish`, the messages it had unanswered when it sent one
// ("node_unanswered_p99", "node_unanswered_max"; at LATENCY_IN_FLIGHT the publisher waits).
// `spread` (for bench/members.py): a cluster's load, over the comma-separated STREAMS in turn,
// IN_FLIGHT one-entry calls unanswered in all: `append` from one Client given the SEEDS (it sends
// each call to its stream's leader), `publish` from one Publish session per stream (in a cluster a
// session carries one stream), on the member that leads it. Every `rate` and `spread` result also has "cpu_us_per_call", the CPU
// this process used per call (the client's cost, on the cores a server shares with it), and
// "calls", every call answered (warm-up included).

const { monitorEventLoopDelay } = require('node:perf_hooks');
const { Client, Publisher } = require('../clients/node');

const PAYLOAD = 100;
const LATENCY_IN_FLIGHT = 64;

function percentile(sorted, p) {
  if (!sorted.length) return 0;
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))];
}

// Counts the calls answered during SECONDS after a one-second warm-up of `loops(running)`, which
// starts the callers, each calling done(started) per answer and stopping once running() is false.
async function timed(seconds, loops) {
  let counting = false;
  let stop = false;
  let count = 0;
  let total = 0; // warm-up and wind-down included
  const latencies = [];
  const done = (started) => {
    total += 1;
    if (!counting) return;
    count += 1;
    if (latencies.length < 200000) latencies.push(Number(process.hrtime.bigint() - started) / 1e6);
  };
  const running = loops(() => !stop, done);
  await new Promise((resolve) => { setTimeout(resolve, 1000); });
  counting = true;
  const t0 = process.hrtime.bigint();
  const cpu = process.cpuUsage();
  await new Promise((resolve) => { setTimeout(resolve, seconds * 1000); });
  counting = false;
  const elapsed = Number(process.hrtime.bigint() - t0) / 1e9;
  const used = process.cpuUsage(cpu);
  stop = true;
  await running;
  latencies.sort((a, b) => a - b);
  return {
    calls_per_s: count / elapsed,
    p50_ms: percentile(latencies, 50),
    p99_ms: percentile(latencies, 99),
    cpu_us_per_call: count ? (used.user + used.system) / count : 0,
    calls: total,
  };
}

// Appends one entry per call to streams[turn], the turn going round from `first`, until stopped.
async function appendLoop(client, streams, first, payload, running, done) {
  for (let turn = first; running(); turn += 1) {
    const started = process.hrtime.bigint();
    await client.append(streams[turn % streams.length], payload);
    done(started);
  }
}

// The calls a loop keeps unanswered: add() counts one in, room(n) resolves once at most n are
// left. One counter and one waiting resolver (a Promise.race over the calls in flight added a
// reaction to each of them per call: 64 microtasks per answer at 64 in flight).
class Window {
  constructor() {
    this.open = 0;
    this.waiter = null; // {limit, resolve, reject}
    this.error = null; // the first call refused: it ends the loop, as a rejection would
  }

  add(call) {
    this.open += 1;
    call.then(() => this.settled(), (error) => {
      this.error = this.error || error;
      this.settled();
    });
  }

  settled() {
    this.open -= 1;
    const { waiter } = this;
    if (waiter && (this.error || this.open <= waiter.limit)) {
      this.waiter = null;
      if (this.error) waiter.reject(this.error);
      else waiter.resolve();
    }
  }

  room(limit) {
    if (this.error) return Promise.reject(this.error);
    if (this.open <= limit) return null;
    return new Promise((resolve, reject) => { this.waiter = { limit, resolve, reject }; });
  }
}

// Publishes one entry per message on `publisher` to streams[turn], keeping `inFlight` unanswered.
async function publishLoop(publisher, streams, inFlight, payload, running, done) {
  const unanswered = new Window();
  for (let turn = 0; running(); turn += 1) {
    const started = process.hrtime.bigint();
    unanswered.add(publisher.publish(streams[turn % streams.length], payload).then(() => done(started)));
    const full = unanswered.room(inFlight - 1);
    if (full) await full;
  }
  await unanswered.room(0);
  await publisher.close();
}

async function rate(address, mode, callers, seconds, inFlight) {
  const stream = `load-${mode}-${process.pid}`;
  const payload = Buffer.alloc(PAYLOAD, 120);
  // A connection per caller, as redis-benchmark's clients have (grpc-js would share one).
  const clients = Array.from({ length: callers }, () => new Client(address, { timeoutMs: 60000, ownConnection: true }));
  await clients[0].append(stream, payload); // the stream exists before the clock starts
  const result = await timed(seconds, (running, done) => Promise.all(clients.map((client) => (
    mode === 'append'
      ? appendLoop(client, [stream], 0, payload, running, done)
      : publishLoop(new Publisher(client, { maxInFlight: inFlight }), [stream], inFlight, payload, running, done)
  ))));
  for (const client of clients) client.close();
  return result;
}

async function spread(seeds, mode, streamList, inFlight, seconds) {
  const streams = streamList.split(',');
  const payload = Buffer.alloc(PAYLOAD, 120);
  const client = new Client(seeds, { timeoutMs: 60000 });
  for (const stream of streams) await client.append(stream, payload); // the layout learned
  const opened = [client];
  let loops;
  if (mode === 'append') {
    loops = (running, done) => Promise.all(Array.from({ length: inFlight },
      (_, i) => appendLoop(client, streams, i, payload, running, done)));
  } else {
    // In a cluster a Publish session carries one stream: one per stream, each opened on the
    // member that leads it (one connection per member).
    const { nodes, streams: placements } = await client.describeCluster();
    const address = new Map(nodes.map((node) => [node.id, node.address]));
    const members = new Map();
    const share = Math.max(1, Math.floor(inFlight / streams.length));
    const publishers = placements.filter((p) => streams.includes(p.name)).map(({ name, leader }) => {
      if (!members.has(leader)) members.set(leader, new Client(address.get(leader), { timeoutMs: 60000 }));
      return [new Publisher(members.get(leader), { maxInFlight: share }), name];
    });
    opened.push(...members.values());
    loops = (running, done) => Promise.all(publishers.map(([publisher, name]) => (
      publishLoop(publisher, [name], share, payload, running, done))));
  }
  const result = await timed(seconds, loops);
  for (const each of opened) each.close();
  return result;
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
  const loopDelay = monitorEventLoopDelay({ resolution: 1 });
  loopDelay.enable();
  const cpu = process.cpuUsage();
  const unanswered = [];
  const answers = []; // µs from each send to its call's answer
  const t0 = process.hrtime.bigint();
  const interval = BigInt(Math.round(1e9 / perSecond));
  const calls = new Window();
  for (let i = 0; i < total; i += 1) {
    const wait = Number(t0 + BigInt(i) * interval - process.hrtime.bigint()) / 1e6;
    if (wait > 0) await new Promise((resolve) => { setTimeout(resolve, wait); });
    const payload = Buffer.alloc(PAYLOAD, 120);
    if (publisher) unanswered.push(publisher.unanswered.length);
    const sent = process.hrtime.bigint();
    payload.writeBigUInt64LE(sent, 0);
    const call = publisher ? publisher.publish(stream, payload) : producer.append(stream, payload);
    calls.add(call.then(() => { answers.push(Number(process.hrtime.bigint() - sent) / 1000); }));
    // A server that falls behind the schedule delays it (and the figures show that), but is
    // never sent more than IN_FLIGHT calls at once (past max_concurrent_calls_per_connection).
    const full = calls.room(LATENCY_IN_FLIGHT - 1);
    if (full) await full;
  }
  await calls.room(0);
  await Promise.race([received, new Promise((resolve) => { setTimeout(resolve, 10000); })]);
  loopDelay.disable();
  const used = process.cpuUsage(cpu);
  if (publisher) await publisher.close();
  producer.close();
  reader.close();
  micros.sort((a, b) => a - b);
  unanswered.sort((a, b) => a - b);
  answers.sort((a, b) => a - b);
  return {
    p50_us: percentile(micros, 50),
    p99_us: percentile(micros, 99),
    received: micros.length,
    // (a 1 ms timer's lateness: the histogram holds whole intervals)
    node_loop_delay_p99_us: Math.max(0, loopDelay.percentile(99) / 1000 - 1000),
    node_loop_delay_max_us: Math.max(0, loopDelay.max / 1000 - 1000),
    node_cpu_us_per_entry: (used.user + used.system) / total,
    node_answer_p50_us: percentile(answers, 50),
    node_answer_p99_us: percentile(answers, 99),
    ...(publisher ? { node_unanswered_p99: percentile(unanswered, 99), node_unanswered_max: unanswered.at(-1) } : {}),
  };
}

async function main() {
  const [command, address, mode, a, b, c] = process.argv.slice(2);
  let result;
  if (command === 'latency') result = await latency(address, mode, Number(a), Number(b));
  else if (command === 'spread') result = await spread(address, mode, a, Number(b), Number(c));
  else result = await rate(address, mode, Number(a), Number(b), Number(c || 64));
  process.stdout.write(`${JSON.stringify(result)}\n`);
}

main().catch((error) => {
  console.error(error);
  process.exitCode = 1;
});
