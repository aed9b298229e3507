'use strict';
// Runs against a real server: STREAMLOG_ADDRESS=host:port node --test test/
// (tests/clients/test_node.py starts one and runs this).

const assert = require('node:assert/strict');
const net = require('node:net');
const { test, after } = require('node:test');
const { Client, Publisher, StreamlogError } = require('..');

const address = process.env.STREAMLOG_ADDRESS;
if (!address) throw new Error('set STREAMLOG_ADDRESS to a running streamlog server');
const client = new Client(address, { timeoutMs: 10000 });
after(() => client.close());

// A TCP proxy to the server whose connections drop() cuts, as a network failure would.
async function droppingProxy() {
  const [host, port] = [address.slice(0, address.lastIndexOf(':')), Number(address.slice(address.lastIndexOf(':') + 1))];
  const sockets = new Set();
  const proxy = net.createServer((down) => {
    const up = net.connect(port, host);
    for (const socket of [down, up]) {
      sockets.add(socket);
      socket.on('error', () => {});
      socket.on('close', () => sockets.delete(socket));
    }
    down.pipe(up);
    up.pipe(down);
  });
  await new Promise((resolve) => { proxy.listen(0, '127.0.0.1', resolve); });
  return {
    address: `127.0.0.1:${proxy.address().port}`,
    drop: () => { for (const socket of sockets) socket.destroy(); },
    close: () => { proxy.close(); for (const socket of sockets) socket.destroy(); },
  };
}

const settled = (promise) => promise.then((a) => a.firstOffset, (error) => error);

test('append and read back, both batch forms', async () => {
  const first = await client.append('node-orders', ['one', Buffer.from('two')]);
  assert.deepEqual([first.firstOffset, first.lastOffset, first.duplicate], [0, 1, false]);
  const second = await client.append('node-orders', [{ payload: 'three', tag: 'k', headers: { h: Buffer.from('v') } }]);
  assert.equal(second.firstOffset, 2);
  const batch = await client.read('node-orders', 0);
  assert.deepEqual(batch.entries.map((e) => [e.offset, e.payload.toString(), e.tag]),
    [[0, 'one', ''], [1, 'two', ''], [2, 'three', 'k']]);
  assert.equal(batch.entries[2].headers.h.toString(), 'v');
  assert.equal(batch.nextOffset, 3);
  assert.equal(batch.gap, null);
});

test('idempotent and conditional appends', async () => {
  const once = await client.append('node-events', 'a', { producerId: 'node-p', producerSequence: 1 });
  const again = await client.append('node-events', 'a', { producerId: 'node-p', producerSequence: 1 });
  assert.equal(again.duplicate, true);
  assert.equal(again.firstOffset, once.firstOffset);
  await assert.rejects(
    client.append('node-events', 'b', { expectedNextOffset: 0 }),
    (error) => error instanceof StreamlogError && error.nextOffset === 1 && error.code === 9,
  );
});

test('appendMany: one result per batch, a refused batch returned as its error', async () => {
  const results = await client.appendMany([
    ['node-many-a', ['a0', 'a1']],
    { stream: '', items: 'bad name' },
    { stream: 'node-many-b', items: [{ payload: 'b0', tag: 't' }], options: { producerId: 'np', producerSequence: 1 } },
  ]);
  assert.deepEqual([results[0].firstOffset, results[0].lastOffset], [0, 1]);
  assert.ok(results[1] instanceof StreamlogError && results[1].code === 3);
  assert.deepEqual([results[2].firstOffset, results[2].duplicate], [0, false]);
  const again = await client.appendMany([{ stream: 'node-many-b', items: [{ payload: 'b0', tag: 't' }],
    options: { producerId: 'np', producerSequence: 1 } }]);
  assert.equal(again[0].duplicate, true);
});

test('subscribe receives history, then live entries', async () => {
  await client.append('node-live', ['h1', 'h2']);
  const seen = [];
  for await (const batch of client.subscribe('node-live', { start: 'oldest' })) {
    for (const entry of batch.entries) seen.push(entry.payload.toString());
    if (seen.length === 2) await client.append('node-live', 'live');
    if (seen.length === 3) break;
  }
  assert.deepEqual(seen, ['h1', 'h2', 'live']);
});

test('a consumer group reads, acknowledges, and has nothing pending after', async () => {
  await client.append('node-jobs', ['j0', 'j1', 'j2']);
  await client.createGroup('node-jobs', 'workers', { start: 'oldest' });
  const batch = await client.readGroup('node-jobs', 'workers', 'w1', { count: 10 });
  assert.deepEqual(batch.entries.map((e) => [e.payload.toString(), e.deliveryCount]),
    [['j0', 1], ['j1', 1], ['j2', 1]]);
  let info = await client.groupInfo('node-jobs', 'workers');
  assert.equal(info.pending, 3);
  const acked = await client.ack('node-jobs', 'workers', batch.entries.map((e) => e.offset));
  assert.deepEqual(acked, { acknowledged: 3, unknown: 0 });
  info = await client.groupInfo('node-jobs', 'workers');
  assert.deepEqual([info.pending, info.nextOffset, info.lag], [0, 3, 0]);
  await client.append('node-jobs', 'j3');
  // Acknowledging in the read itself: nothing new pending but the entry just read.
  const next = await client.readGroup('node-jobs', 'workers', 'w1', { count: 10, blockMs: 2000 });
  assert.deepEqual(next.entries.map((e) => e.payload.toString()), ['j3']);
  const last = await client.readGroup('node-jobs', 'workers', 'w1', { ack: [3] });
  assert.equal(last.entries.length, 0);
  assert.equal((await client.groupInfo('node-jobs', 'workers')).pending, 0);
});

test('errors carry the status code', async () => {
  await assert.rejects(client.info('node-missing'), (error) => error.code === 5 && /NOT_FOUND/.test(error.message));
});

test('a publisher pipelines messages, answered in order, a refused one alone', async () => {
  const publisher = new Publisher(client, { maxInFlight: 16 });
  try {
    const answers = Array.from({ length: 100 }, (_, i) => publisher.publish('node-published', `m${i}`));
    // Its rejection is expected: handled from the start.
    const refused = assert.rejects(publisher.publish('', 'nameless'),
      (error) => error instanceof StreamlogError && error.code === 3);
    const after = publisher.publish('node-published', [{ payload: 'tagged', tag: 't' }]);
    assert.deepEqual((await Promise.all(answers)).map((a) => a.firstOffset), [...Array(100).keys()]);
    await refused;
    assert.equal((await after).firstOffset, 100);
  } finally {
    await publisher.close();
  }
  const batch = await client.read('node-published', 98, { count: 10 });
  assert.deepEqual(batch.entries.map((e) => [e.payload.toString(), e.tag]),
    [['m98', ''], ['m99', ''], ['tagged', 't']]);
});

test('a publisher that reconnects resends what was not answered, written once', async () => {
  const publisher = new Publisher(client, { producerId: 'node-publisher', firstSequence: 1 });
  try {
    const answers = Array.from({ length: 50 }, (_, i) => publisher.publish('node-resent', `r${i}`));
    publisher.reconnect(); // as after UNAVAILABLE: a new session, every unanswered message again
    const results = await Promise.all(answers);
    assert.deepEqual(results.map((a) => a.firstOffset), [...Array(50).keys()]);
  } finally {
    await publisher.close();
  }
  assert.equal((await client.info('node-resent')).entries, 50);
});

test('a publisher encodes a message when published: its Buffer reused after, a resend writes what was published', async () => {
  const publisher = new Publisher(client, { producerId: 'node-reused', firstSequence: 1 });
  const payload = Buffer.alloc(4);
  try {
    const answers = [];
    for (let i = 0; i < 20; i += 1) {
      payload.writeUInt32BE(i);
      answers.push(publisher.publish('node-reused', payload));
    }
    payload.fill(0xff);
    publisher.reconnect(); // writes again every message not yet answered
    await Promise.all(answers);
  } finally {
    await publisher.close();
  }
  const batch = await client.read('node-reused', 0, { count: 100 });
  assert.deepEqual(batch.entries.map((e) => e.payload.readUInt32BE(0)), [...Array(20).keys()]);
});

test('a publisher whose session the server ends fails what it left, then opens a new one', { timeout: 20000 }, async () => {
  const publisher = new Publisher(client);
  try {
    // Over any server's max_message_bytes (16 MiB by default): gRPC ends the call.
    const big = settled(publisher.publish('node-ended', Buffer.alloc(17 << 20)));
    const behind = settled(publisher.publish('node-ended', 'behind it'));
    for (const error of [await big, await behind]) {
      assert.ok(error instanceof StreamlogError && error.code === 8, String(error)); // RESOURCE_EXHAUSTED
    }
    assert.equal((await publisher.publish('node-ended', 'after')).firstOffset, 0);
  } finally {
    await publisher.close();
  }
});

// A publisher whose client reaches the server through a droppingProxy, for `body`; closed after.
async function throughProxy(timeoutMs, options, body) {
  const proxy = await droppingProxy();
  const dropped = new Client(proxy.address, { timeoutMs });
  const publisher = new Publisher(dropped, options);
  try {
    await body(publisher, proxy);
  } finally {
    await publisher.close();
    dropped.close();
    proxy.close();
  }
}

test('a publisher whose connection drops fails what it left unanswered, then opens a new session', { timeout: 20000 }, async () => {
  await throughProxy(10000, {}, async (publisher, proxy) => {
    await publisher.publish('node-dropped', 'first');
    const answers = Array.from({ length: 20 }, (_, i) => settled(publisher.publish('node-dropped', `d${i}`)));
    proxy.drop();
    for (const answer of await Promise.all(answers)) {
      // Written or not, each either has its offset or failed with the call's status.
      assert.ok(typeof answer === 'number' || (answer instanceof StreamlogError && answer.code === 14), String(answer));
    }
    const after = await publisher.publish('node-dropped', 'after');
    assert.equal(after.firstOffset, (await client.info('node-dropped')).entries - 1);
  });
});

test('a publisher with a producer id resends over a dropped connection, each message written once', { timeout: 20000 }, async () => {
  const options = { producerId: 'node-dropped-once', firstSequence: 1, retryMs: 10 };
  await throughProxy(10000, options, async (publisher, proxy) => {
    await publisher.publish('node-dropped-once', 'first');
    const answers = Array.from({ length: 50 }, (_, i) => publisher.publish('node-dropped-once', `o${i}`));
    proxy.drop();
    assert.deepEqual((await Promise.all(answers)).map((a) => a.firstOffset), Array.from({ length: 50 }, (_, i) => i + 1));
    proxy.drop(); // nothing unanswered: the next message opens a new session
    assert.equal((await publisher.publish('node-dropped-once', 'last')).firstOffset, 51);
  });
  const batch = await client.read('node-dropped-once', 0, { count: 100 });
  assert.deepEqual(batch.entries.map((e) => e.payload.toString()),
    ['first', ...Array.from({ length: 50 }, (_, i) => `o${i}`), 'last']);
});

test('a publisher with a producer id fails its messages once its server stayed unreachable for timeoutMs', { timeout: 20000 }, async () => {
  const options = { producerId: 'node-unreachable', firstSequence: 1, retryMs: 50 };
  await throughProxy(1000, options, async (publisher, proxy) => {
    await publisher.publish('node-unreachable', 'first');
    const unanswered = settled(publisher.publish('node-unreachable', 'second'));
    proxy.close(); // the connection drops and no new one is accepted
    const started = Date.now();
    const error = await unanswered;
    assert.ok(error instanceof StreamlogError && error.code === 14, String(error)); // UNAVAILABLE
    assert.ok(Date.now() - started >= 900, `failed after ${Date.now() - started} ms`);
  });
});

test('closing a publisher whose session ended resolves', { timeout: 20000 }, async () => {
  await throughProxy(10000, {}, async (publisher, proxy) => {
    await publisher.publish('node-closed-after', 'first');
    const unanswered = settled(publisher.publish('node-closed-after', 'second'));
    proxy.drop();
    await unanswered;
    await publisher.close();
  });
});
