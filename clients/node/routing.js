'use strict';
// Where the Node client's calls go: the cluster layout it learned, and one stub (channel) per
// node it talks to. The same rules as the Python client's (clients/_routing.py); this module
// does no I/O, the Client (index.js) makes the calls.
//
// Against a single server (DescribeCluster answers with no cluster name) every call goes to the
// one seed that answered. In a cluster, each call on a stream goes to the stream's leader with
// metadata `streamlog-route: redirect`: a node that does not lead the stream answers UNAVAILABLE
// naming the leader (trailer `streamlog-leader-address`) instead of forwarding the call, so a
// stale layout costs one refused call, not a hop on every call.
//
// What is retried after UNAVAILABLE (within the call's deadline): any call refused with a
// redirect (refused before it was served); otherwise (a node went down, the leader changed under
// the call) only calls that may run twice: reads, idempotent admin calls, and appends that carry
// a producer id (the server answers a resend as a duplicate).

const grpc = require('@grpc/grpc-js');

const ROUTE_KEY = 'streamlog-route';
const ROUTE_REDIRECT = 'redirect';
const LEADER_ADDRESS = 'streamlog-leader-address';
// A layout lookup is quick: a node that takes longer is passed over for the next (a paused node
// must not hold a call for its whole deadline).
const LOOKUP_TIMEOUT_MS = 5000;
const FIRST_PAUSE_MS = 50;
const MAX_PAUSE_MS = 1000;

// Calls that may run twice with the outcome of once. A group read may deliver entries twice:
// they stay pending and are redelivered (at-least-once).
const IDEMPOTENT = new Set([
  'Read', 'GetStreamInfo', 'ListGroups', 'GetGroupInfo', 'GetPending', 'SeekTime', 'CountRange',
  'SetStreamConfig', 'SetGroupConfig', 'SetGroupOffset', 'Ack', 'Trim',
]);

// The addresses given: one, several in an array, or several comma-separated.
function seedAddresses(address) {
  const parts = Array.isArray(address) ? address : String(address).split(',');
  const seeds = parts.map((part) => String(part).trim()).filter((part) => part);
  if (!seeds.length) throw new Error('no server address given');
  return seeds;
}

// The leader's address a node named when it refused a call with a redirect (a grpc-js error, or
// a StreamlogError wrapping one), else null.
function redirectAddress(error) {
  const metadata = error && (error.metadata || (error.cause && error.cause.metadata));
  if (!metadata || typeof metadata.get !== 'function') return null;
  const [address] = metadata.get(LEADER_ADDRESS);
  return address ? String(address) : null;
}

// Whether a call that failed with `error` may be sent again (see the top of this file).
function retryable(method, request, error) {
  if (error.code !== grpc.status.UNAVAILABLE) return false;
  if (redirectAddress(error) !== null) return true;
  return IDEMPOTENT.has(method) || (method === 'Append' && Boolean(request.producer_id));
}

function transient(error) {
  return error.code === grpc.status.UNAVAILABLE || error.code === grpc.status.DEADLINE_EXCEEDED;
}

// The layout a client learned, and its stubs (one per node address, opened when first used).
// `cluster`: null until a DescribeCluster answered, then whether the server is a cluster's node.
class Routes {
  constructor(seeds, openStub) {
    this.seeds = seeds;
    this.openStub = openStub;
    this.stubs = new Map();
    this.cluster = null;
    this.defaultAddress = seeds[0]; // where calls go while nothing better is known
    this.leaders = new Map(); // stream -> its leader's address
    this.nodes = []; // live nodes' addresses, as last described
    this.suspects = new Set(); // addresses that failed since the last description
    // Counters, for tests and monitoring: redirects followed, layouts learned.
    this.redirects = 0;
    this.lookups = 0;
  }

  stub(address) {
    if (!this.stubs.has(address)) this.stubs.set(address, this.openStub(address));
    return this.stubs.get(address);
  }

  close() {
    for (const stub of this.stubs.values()) stub.close();
  }

  // Where calls on `stream` go now: the only server, or the stream's leader when known; null
  // when the layout must be looked up first.
  leader(stream) {
    if (this.cluster === false) return this.defaultAddress;
    return this.leaders.get(stream) || null;
  }

  // Addresses to ask for the layout, in order: nodes not seen failing, then the others.
  describers() {
    const known = [...new Set([this.defaultAddress, ...this.nodes, ...this.seeds])];
    return [...known.filter((a) => !this.suspects.has(a)), ...known.filter((a) => this.suspects.has(a))];
  }

  // Take in what the node at `address` described: a DescribeClusterResponse, its streams from
  // every page.
  learn(address, description) {
    this.lookups += 1;
    this.defaultAddress = address;
    if (!description.cluster_name) {
      this.cluster = false; // a single server: nothing to route, ever
      return;
    }
    this.cluster = true;
    const addresses = new Map(description.nodes
      .filter((node) => node.alive && node.address).map((node) => [node.id, node.address]));
    this.nodes = [...addresses.values()];
    this.suspects.clear();
    for (const placement of description.streams) {
      const leader = addresses.get(placement.leader);
      if (leader) this.leaders.set(placement.name, leader);
      else this.leaders.delete(placement.name); // no leader now (an election): look again next time
    }
  }

  // A call on `stream` failed with `error`: follow its redirect if it named the leader (true),
  // else forget the stream's leader, so that the next call looks it up (false).
  failed(stream, error) {
    const address = redirectAddress(error);
    if (address !== null) {
      this.redirects += 1;
      this.leaders.set(stream, address);
      this.suspects.delete(address);
      return true;
    }
    const previous = this.leaders.get(stream);
    this.leaders.delete(stream);
    if (previous) this.suspects.add(previous);
    return false;
  }
}

// The deadline and the pauses of one call's attempts.
class Attempts {
  constructor(timeoutMs) {
    this.deadline = Date.now() + timeoutMs;
    this.pauseMs = FIRST_PAUSE_MS;
  }

  // The deadline of the next attempt: the call's, or sooner (`capMs` from now).
  attemptDeadline(capMs = Infinity) {
    return new Date(Math.min(this.deadline, Date.now() + capMs));
  }

  // How long to wait before the next attempt (none after a first redirect: the leader is named);
  // null when the deadline leaves no time for one.
  pause(redirected) {
    const pause = redirected && this.pauseMs === FIRST_PAUSE_MS
      ? 0 : this.pauseMs / 2 + Math.random() * (this.pauseMs / 2); // jitter: clients do not retry in step
    this.pauseMs = Math.min(this.pauseMs * 2, MAX_PAUSE_MS);
    return Date.now() + pause >= this.deadline ? null : pause;
  }
}

module.exports = {
  Attempts, LOOKUP_TIMEOUT_MS, ROUTE_KEY, ROUTE_REDIRECT, Routes, redirectAddress, retryable,
  seedAddresses, transient,
};
