'use strict';
// Runs against a real three-node cluster whose streams have three replicas (acks=quorum):
// STREAMLOG_CLUSTER_NODES='[{"id": "n1", "address": "127.0.0.1:7070", "pid": 1234}, ...]'
// node --test test/cluster.test.js (tests/cluster/test_node_client.py starts the cluster and
// runs this). The second test kills the leader of its stream with SIGKILL, by its pid.

const assert = require('node:assert/strict');
const { test, after } = require('node:test');
const { Client } = require('..');

const nodes = JSON.parse(process.env.STREAMLOG_CLUSTER_NODES || 'null');
if (!nodes) throw new Error('set STREAMLOG_CLUSTER_NODES to a running three-node cluster');
const seeds = nodes.map((node) => node.address);

async function leaderOf(client, stream) {
  const { streams } = await client.describeCluster(stream);
  const [placement] = streams.filter((s) => s.name === stream);
  return nodes.find((node) => node.id === placement.leader);
}

test('calls go straight to the stream\'s leader; a stale route is redirected there', async () => {
  const client = new Client(seeds, { timeoutMs: 20000 });
  after(() => client.close());
  await client.append('node-routed', 'first');
  const leader = await leaderOf(client, 'node-routed');
  assert.equal(await client.route('node-routed'), leader.address);
  assert.equal(client.routes.redirects, 0);
  // A layout gone stale (as after a leader change the client has not heard of): the node called
  // refuses the call unserved, naming the leader, and the client calls the leader at once.
  const other = nodes.find((node) => node.id !== leader.id);
  client.routes.leaders.set('node-routed', other.address);
  const second = await client.append('node-routed', 'second');
  assert.equal(second.firstOffset, 1);
  assert.equal(client.routes.redirects, 1);
  assert.equal(await client.route('node-routed'), leader.address);
  const batch = await client.read('node-routed', 0);
  assert.deepEqual(batch.entries.map((e) => e.payload.toString()), ['first', 'second']);
});

test('appends, reads and a subscription keep going through a kill -9 of the leader; nothing acknowledged is lost',
  { timeout: 120000 }, async () => {
    const stream = 'node-failover';
    const client = new Client(seeds, { timeoutMs: 60000 });
    after(() => client.close());
    const acknowledged = []; // {offset, payload}
    let sequence = 0;
    // Appends with a producer id (retried through the failover, never written twice), each read
    // back at once (reads are retried too).
    async function appendAndReadBack() {
      sequence += 1;
      const payload = `entry-${sequence}`;
      const result = await client.append(stream, payload, { producerId: 'node-failover', producerSequence: sequence });
      acknowledged.push({ offset: result.firstOffset, payload });
      const batch = await client.read(stream, result.firstOffset, { count: 1 });
      assert.equal(batch.entries[0].payload.toString(), payload);
    }
    for (let i = 0; i < 20; i += 1) await appendAndReadBack();
    // A subscription from the start, the first call of a client of its own (it looks the leader up
    // and opens there): it reopens on the new leader after the kill, from where it was, until it
    // sees the entry appended last.
    const reader = new Client(seeds, { timeoutMs: 60000 });
    after(() => reader.close());
    const delivered = [];
    const subscription = (async () => {
      for await (const batch of reader.subscribe(stream, { start: 'oldest' })) {
        delivered.push(...batch.entries);
        if (delivered.some((e) => e.payload.toString() === 'last')) return null;
      }
      return new Error('the subscription ended');
    })().catch((error) => error);
    const leader = await leaderOf(client, stream);
    const lookups = client.routes.lookups;
    const before = acknowledged.length;
    process.kill(leader.pid, 'SIGKILL');
    // The loop goes on: the first append after the kill waits out the election, inside its call.
    while (acknowledged.length < before + 20) await appendAndReadBack();
    sequence += 1;
    const last = await client.append(stream, 'last', { producerId: 'node-failover', producerSequence: sequence });
    acknowledged.push({ offset: last.firstOffset, payload: 'last' });
    assert.equal(await subscription, null);
    assert.equal(reader.routes.cluster, true);
    const now = await client.route(stream);
    assert.notEqual(now, leader.address);
    assert.ok(client.routes.lookups > lookups, 'the client looked the layout up again');
    // Every acknowledged entry is where its acknowledgement said, and none is there twice.
    const stored = [];
    for (let offset = 0; ;) {
      const batch = await client.read(stream, offset, { count: 1000 });
      if (!batch.entries.length) break;
      stored.push(...batch.entries);
      offset = batch.nextOffset;
    }
    const byOffset = new Map(stored.map((e) => [e.offset, e.payload.toString()]));
    for (const { offset, payload } of acknowledged) assert.equal(byOffset.get(offset), payload);
    const payloads = stored.map((e) => e.payload.toString());
    assert.equal(new Set(payloads).size, payloads.length, 'a payload was written twice');
    assert.equal(stored.length, acknowledged.length);
    // The subscription delivered every entry once, in order, across the failover.
    assert.deepEqual(delivered.map((e) => [e.offset, e.payload.toString()]),
      stored.map((e) => [e.offset, e.payload.toString()]));
  });
