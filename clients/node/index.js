'use strict';
// A small streamlog client for Node.js: @grpc/grpc-js with @grpc/proto-loader, which
// reads protos/streamlog/v1/streamlog.proto at run time (no generated code to keep in
// step). Promises for unary calls, an async iterator for subscriptions. In a cluster, calls on
// a stream go straight to its leader (routing.js).
//
// Offsets are int64 on the wire. They are loaded as strings (so nothing is rounded)
// and handed to you as Numbers, which hold every integer below 2^53; a larger offset
// throws a RangeError rather than silently losing precision.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');
const protobuf = require('protobufjs');
const {
  Attempts, LOOKUP_TIMEOUT_MS, ROUTE_KEY, ROUTE_REDIRECT, Routes, retryable, seedAddresses, transient,
} = require('./routing');

const PROTO = process.env.STREAMLOG_PROTO
  || path.join(__dirname, '..', '..', 'protos', 'streamlog', 'v1', 'streamlog.proto');

let service;
function loadService() {
  if (!service) {
    const definition = protoLoader.loadSync(PROTO, {
      keepCase: true,
      longs: String,
      enums: String,
      bytes: Buffer,
      defaults: true,
      oneofs: true,
    });
    service = grpc.loadPackageDefinition(definition).streamlog.v1.StreamLogService;
  }
  return service;
}

// Publish's messages, encoded and decoded by protobufjs itself: proto-loader's stub would turn every
// answer into a plain object with every default filled in and its int64s as strings, and encode a
// message again on each resend. A session's messages are the client's hot path.
let publishTypes;
function loadPublishTypes() {
  if (!publishTypes) {
    const root = new protobuf.Root().loadSync(PROTO, { keepCase: true });
    publishTypes = {
      request: root.lookupType('streamlog.v1.PublishRequest'),
      response: root.lookupType('streamlog.v1.PublishResponse'),
    };
  }
  return publishTypes;
}

const PUBLISH_METHOD = '/streamlog.v1.StreamLogService/Publish';

// An int64 as protobufjs decodes it (a Long, or a Number when it fits 32 bits) as a Number.
function longToNumber(value) {
  return toNumber(typeof value === 'number' ? value : value.toNumber());
}

function toNumber(value) {
  const number = Number(value);
  if (!Number.isSafeInteger(number)) {
    throw new RangeError(`offset ${value} does not fit a JavaScript Number`);
  }
  return number;
}

function toEntry(message, deliveryCount) {
  return {
    offset: toNumber(message.offset),
    timestampMs: toNumber(message.timestamp_ms),
    tag: message.tag,
    payload: message.payload,
    headers: message.headers,
    deliveryCount: deliveryCount || 0,
  };
}

function toBatch(reply) {
  const counts = reply.delivery_counts || [];
  return {
    entries: reply.entries.map((e, i) => toEntry(e, counts[i])),
    firstOffset: toNumber(reply.first_offset),
    nextOffset: toNumber(reply.next_offset),
    endOffset: toNumber(reply.end_offset),
    gap: reply.gap
      ? { startOffset: toNumber(reply.gap.start_offset), endOffset: toNumber(reply.gap.end_offset),
        reason: reply.gap.reason }
      : null,
  };
}

// An AppendRequest (or an AppendMany batch): items and options as Client.append takes them.
function appendRequest(stream, items, options = {}) {
  const list = Array.isArray(items) ? items : [items];
  const plain = list.every((item) => Buffer.isBuffer(item) || typeof item === 'string');
  const request = { stream };
  if (plain) request.payloads = list.map((item) => Buffer.from(item));
  else request.entries = list.map((item) => ({ ...item, payload: Buffer.from(item.payload) }));
  if (options.producerId !== undefined) {
    request.producer_id = options.producerId;
    request.producer_sequence = String(options.producerSequence);
  }
  if (options.expectedNextOffset !== undefined) {
    request.expected_next_offset = String(options.expectedNextOffset);
  }
  return request;
}

function toAppendResult(reply) {
  return {
    firstOffset: toNumber(reply.first_offset),
    lastOffset: toNumber(reply.last_offset),
    timestampMs: toNumber(reply.timestamp_ms),
    duplicate: reply.duplicate,
  };
}

class StreamlogError extends Error {
  constructor(error) {
    super(`${grpc.status[error.code] || error.code}: ${error.details}`);
    this.name = 'StreamlogError';
    this.code = error.code;
    this.details = error.details;
    this.cause = error;
    // A failed conditional append says where the stream actually is.
    const next = error.metadata && error.metadata.get('streamlog-next-offset')[0];
    this.nextOffset = next === undefined ? null : toNumber(String(next));
  }
}

// gRPC dials a node that refused it again only after a backoff growing to 2 min: a restarted
// node would stay out of reach long after it serves. Dial again within a second.
const CHANNEL_OPTIONS = { 'grpc.initial_reconnect_backoff_ms': 100, 'grpc.max_reconnect_backoff_ms': 1000 };

function sleep(ms) {
  return new Promise((resolve) => { setTimeout(resolve, ms); });
}

class Client {
  // address: "host:port", or several (an array, or comma-separated): seeds, of which the first
  // that answers is used; in a cluster, each call on a stream goes to the stream's leader.
  // options: token (sent as `authorization: Bearer ...`), rootCerts / certChain / privateKey
  // (Buffers; any of them turns TLS on), timeoutMs (each call's deadline, its retries included),
  // ownConnection (true: connections of this client's own; by default grpc-js shares one per
  // address between all the clients of a process).
  constructor(address, options = {}) {
    const Service = loadService();
    const tls = options.rootCerts || options.certChain || options.tls;
    const credentials = tls
      ? grpc.credentials.createSsl(options.rootCerts || null, options.privateKey || null,
        options.certChain || null)
      : grpc.credentials.createInsecure();
    const seeds = seedAddresses(address);
    this.address = seeds.join(',');
    const channelOptions = options.ownConnection
      ? { ...CHANNEL_OPTIONS, 'grpc.use_local_subchannel_pool': 1 }
      : CHANNEL_OPTIONS;
    this.routes = new Routes(seeds, (node) => new Service(node, credentials, channelOptions));
    this.token = options.token || null;
    this.timeoutMs = options.timeoutMs || 30000;
  }

  // The stub of the seed that answered (the first, until one did not).
  get stub() {
    return this.routes.stub(this.routes.defaultAddress);
  }

  close() {
    this.routes.close();
  }

  // routed: ask a node that does not lead the stream to name its leader rather than forward.
  metadata(routed = false) {
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    if (routed) metadata.set(ROUTE_KEY, ROUTE_REDIRECT);
    return metadata;
  }

  // One attempt; rejects with the grpc-js error (its trailers kept for the redirect).
  static attempt(stub, method, request, metadata, deadline) {
    return new Promise((resolve, reject) => {
      stub[method](request, metadata, { deadline }, (error, reply) => {
        if (error) reject(error);
        else resolve(reply);
      });
    });
  }

  // A unary call; one on a stream in a cluster goes to its leader, and again (after a redirect,
  // or where sending it twice is safe) until it is answered or its deadline passes.
  async unary(method, request, waitMs = 0) {
    const attempts = new Attempts(this.timeoutMs + waitMs);
    const stream = request.stream;
    if (!stream || this.routes.cluster === false) {
      try {
        return await Client.attempt(this.stub, method, request, this.metadata(), attempts.attemptDeadline());
      } catch (error) {
        throw new StreamlogError(error);
      }
    }
    for (;;) {
      const address = await this.route(stream); // after a failure: where failed() below pointed
      const routed = this.routes.cluster === true;
      try {
        return await Client.attempt(this.routes.stub(address), method, request, this.metadata(routed),
          attempts.attemptDeadline());
      } catch (error) {
        if (!(routed && retryable(method, request, error))) throw new StreamlogError(error);
        const pause = attempts.pause(this.routes.failed(stream, error));
        if (pause === null) throw new StreamlogError(error);
        await sleep(pause);
      }
    }
  }

  // The address calls on `stream` go to: its leader's in a cluster (looked up with
  // DescribeCluster once, then cached), the server's otherwise (one DescribeCluster, ever).
  // When no node can say, the first seed that answered.
  async route(stream) {
    const { routes } = this;
    const known = routes.leader(stream);
    if (known) return known;
    for (const candidate of routes.describers()) {
      let description;
      try {
        description = await this.describePages(routes.stub(candidate), stream, LOOKUP_TIMEOUT_MS);
      } catch (error) {
        if (transient(error)) continue; // down or not ready: ask another
        if (routes.cluster === null) routes.cluster = false; // DescribeCluster refused: not routable
        break;
      }
      routes.learn(candidate, description);
      return routes.leader(stream) || candidate;
    }
    return routes.defaultAddress;
  }

  // A DescribeClusterResponse with the streams of every page (each page's deadline: timeoutMs).
  async describePages(stub, prefix, timeoutMs) {
    const streams = [];
    let token = '';
    for (;;) {
      const reply = await Client.attempt(stub, 'DescribeCluster', { prefix, page_token: token },
        this.metadata(), new Date(Date.now() + timeoutMs));
      streams.push(...reply.streams);
      token = reply.next_page_token;
      if (!token) return { ...reply, streams };
    }
  }

  // The cluster's nodes and where its streams starting with `prefix` live, as the seed that
  // answered sees it. A single server answers as one node, with an empty clusterName.
  async describeCluster(prefix = '') {
    let reply;
    try {
      reply = await this.describePages(this.stub, prefix, this.timeoutMs);
    } catch (error) {
      throw new StreamlogError(error);
    }
    return {
      clusterName: reply.cluster_name,
      nodeId: reply.node_id,
      nodes: reply.nodes.map((n) => ({ id: n.id, address: n.address, alive: n.alive, controller: n.controller })),
      streams: reply.streams.map((s) => ({
        name: s.name, leader: s.leader, replicas: s.replicas, inSyncReplicas: s.in_sync_replicas,
        leaderEpoch: toNumber(s.leader_epoch),
      })),
    };
  }

  // The stub and metadata to open a session on `stream` with: its leader's, with a redirect asked
  // for, when the layout knows it; else the seed's, which serves or forwards it.
  sessionRoute(stream) {
    const address = this.routes.cluster === true ? this.routes.leader(stream) : null;
    if (!address) return { stub: this.stub, metadata: this.metadata() };
    return { stub: this.routes.stub(address), metadata: this.metadata(true) };
  }

  // payloads: Buffers/strings (the fast `payloads` form), or entries {payload, tag, headers}.
  // options: producerId + producerSequence (idempotent), expectedNextOffset (conditional).
  async append(stream, items, options = {}) {
    return toAppendResult(await this.unary('Append', appendRequest(stream, items, options)));
  }

  // One call for many streams: batches are {stream, items, options} (as append's arguments)
  // or [stream, items] pairs. Resolves to one value per batch, in order: its result (as
  // append's), or the StreamlogError it was refused with (returned, not thrown: one bad
  // batch fails no other). Rejects only when the call fails as a whole.
  async appendMany(batches) {
    const request = {
      batches: batches.map((b) => (Array.isArray(b)
        ? appendRequest(b[0], b[1]) : appendRequest(b.stream, b.items, b.options))),
    };
    const reply = await this.unary('AppendMany', request);
    return reply.results.map((result) => (result.error
      ? new StreamlogError({ code: result.error.code, details: result.error.message })
      : toAppendResult(result)));
  }

  async read(stream, offset = 0, options = {}) {
    const request = {
      stream, offset: String(offset), count: options.count || 0, block_ms: options.blockMs || 0,
      reverse: Boolean(options.reverse),
    };
    return toBatch(await this.unary('Read', request, options.blockMs || 0));
  }

  // Follows a stream: `for await (const batch of client.subscribe('s', {start: 'oldest'}))`.
  // start: an offset, 'oldest' or 'latest'. Breaking out of the loop cancels the call. In a
  // cluster, after a leader change it reopens on the new leader from where it was.
  subscribe(stream, options = {}) {
    const start = options.start === undefined ? 'oldest' : options.start;
    const request = { stream, count: options.count || 0 };
    if (start === 'oldest') request.start = 'START_POSITION_OLDEST';
    else if (start === 'latest') request.start = 'START_POSITION_LATEST';
    else Object.assign(request, { start: 'START_POSITION_OFFSET', offset: String(start) });
    return this.follow(request);
  }

  // A consumer's subscription; in a cluster it reopens as it was opened after a leader change
  // (the group keeps its place).
  subscribeGroup(stream, group, consumer, options = {}) {
    return this.follow({ stream, group, consumer, count: options.count || 0 });
  }

  // The batches of a Subscribe call, opened on the stream's leader (looked up first). In a
  // cluster, a call that ends with UNAVAILABLE (the leader changed or went down) is opened again,
  // with backoff, within timeoutMs of the last batch: a plain subscription from the next offset it
  // had not seen.
  async* follow(request) {
    let attempts = null; // since the last batch
    for (;;) {
      await this.route(request.stream);
      const { stub, metadata } = this.sessionRoute(request.stream);
      const call = stub.Subscribe(request, metadata);
      try {
        for await (const reply of call) {
          attempts = null;
          const batch = toBatch(reply);
          if (!request.group) {
            Object.assign(request, { start: 'START_POSITION_OFFSET', offset: String(batch.nextOffset) });
          }
          yield batch;
        }
        return;
      } catch (error) {
        if (error.code === grpc.status.CANCELLED) return;
        if (!(this.routes.cluster === true && error.code === grpc.status.UNAVAILABLE)) {
          throw new StreamlogError(error);
        }
        attempts = attempts || new Attempts(this.timeoutMs);
        const pause = attempts.pause(this.routes.failed(request.stream, error));
        if (pause === null) throw new StreamlogError(error);
        await sleep(pause);
      } finally {
        call.cancel();
      }
    }
  }

  // start: 'oldest', 'latest' or an offset.
  async createGroup(stream, group, options = {}) {
    const start = options.start === undefined ? 'oldest' : options.start;
    const request = { stream, group, create_stream: Boolean(options.createStream) };
    if (start === 'oldest') request.start = 'START_POSITION_OLDEST';
    else if (start === 'latest') request.start = 'START_POSITION_LATEST';
    else Object.assign(request, { start: 'START_POSITION_OFFSET', offset: String(start) });
    return (await this.unary('CreateGroup', request)).group;
  }

  // Reads as `consumer` of `group`; options.ack acknowledges earlier offsets in the same call.
  async readGroup(stream, group, consumer, options = {}) {
    const request = {
      stream, group, consumer, count: options.count || 0, block_ms: options.blockMs || 0,
      ack_offsets: (options.ack || []).map(String),
    };
    return toBatch(await this.unary('Read', request, options.blockMs || 0));
  }

  async ack(stream, group, offsets) {
    const reply = await this.unary('Ack', { stream, group, offsets: offsets.map(String) });
    return { acknowledged: toNumber(reply.acknowledged), unknown: toNumber(reply.unknown) };
  }

  async groupInfo(stream, group) {
    const info = (await this.unary('GetGroupInfo', { stream, group })).group;
    return {
      name: info.name,
      nextOffset: toNumber(info.next_offset),
      pending: toNumber(info.pending),
      lag: info.lag === null || info.lag === undefined ? null : toNumber(info.lag),
      consumers: info.consumers.map((c) => ({ name: c.name, pending: toNumber(c.pending) })),
    };
  }

  async info(stream) {
    const info = (await this.unary('GetStreamInfo', { stream })).info;
    return {
      name: info.name,
      firstOffset: toNumber(info.first_offset),
      nextOffset: toNumber(info.next_offset),
      entries: toNumber(info.entries),
    };
  }
}

// A Publish session: publish() sends one append as a message, without waiting for earlier
// answers, and returns a Promise of its result; the server answers in order. A refused message
// rejects its own Promise (a StreamlogError with its status) and the session goes on. With a
// producerId, every message carries the next sequence, and when the call fails with
// UNAVAILABLE the messages not yet answered are written again, in order, on a new session:
// those the old one wrote come back as duplicates, so nothing is written twice. Otherwise a call
// that ends rejects what it left unanswered with its status, and the next publish() opens a new
// session. Nothing is written to a call once its status has arrived.
class Publisher {
  // options: producerId (resends become safe), maxInFlight (publish() waits past it),
  // retryMs (pause before a new session), firstSequence (default: now in microseconds, so a
  // restarted producer with the same id never reuses a sequence the server remembers).
  constructor(client, options = {}) {
    this.client = client;
    this.types = loadPublishTypes();
    this.producerId = options.producerId || null;
    this.maxInFlight = options.maxInFlight || 1000;
    this.retryMs = options.retryMs === undefined ? 100 : options.retryMs;
    this.sequence = options.firstSequence === undefined ? Date.now() * 1000 : options.firstSequence;
    this.nextId = 0;
    this.unanswered = []; // {id, message (encoded), resolve, reject}, in the order sent
    this.room = []; // publish() calls waiting for maxInFlight to allow them
    this.closing = null;
    this.session = null; // {call, failure}: the current call; null once it ended
    this.resendTimer = null; // set while the unanswered messages wait for a new session
    this.failingSince = null; // when sessions started failing with nothing answered since
    this.open();
  }

  open() {
    const { response } = this.types;
    // Messages go out as the bytes publish() encoded; answers are decoded, not made plain objects.
    const call = this.client.stub.makeBidiStreamRequest(PUBLISH_METHOD, (bytes) => bytes,
      (bytes) => response.decode(bytes), this.client.metadata());
    const session = { call, failure: null };
    this.session = session;
    // Only the current session's events count: not those of a session replaced.
    call.on('data', (reply) => {
      if (session === this.session) this.answered(reply);
    });
    // grpc-js emits 'error' as the call's status arrives, and 'end' once the answers that came
    // before it are delivered: from the first nothing is written, at the second the rest settle.
    call.on('error', (error) => {
      session.failure = session.failure || error;
    });
    call.on('end', () => {
      if (session === this.session) this.ended(session.failure);
    });
  }

  // Whether a message may be written now: a session is open and its status has not arrived.
  writable() {
    return this.session !== null && this.session.failure === null;
  }

  // items: as Client.append's (Buffers/strings, or entries {payload, tag, headers}). The message
  // is encoded at once: the caller may reuse its Buffers as soon as publish() returns.
  publish(stream, items) {
    if (this.unanswered.length >= this.maxInFlight) {
      return new Promise((resolve) => { this.room.push(resolve); }).then(() => this.publish(stream, items));
    }
    if (this.closing) return Promise.reject(new Error('the publisher is closed'));
    const list = Array.isArray(items) ? items : [items];
    const plain = list.every((item) => Buffer.isBuffer(item) || typeof item === 'string');
    this.nextId += 1;
    const request = { stream, request_id: this.nextId };
    if (plain) request.payloads = list.map((item) => (typeof item === 'string' ? Buffer.from(item) : item));
    else request.entries = list.map((item) => ({ ...item, payload: Buffer.from(item.payload) }));
    if (this.producerId) {
      request.producer_id = this.producerId;
      request.producer_sequence = this.sequence;
      this.sequence += 1;
    }
    const { request: type } = this.types;
    const message = type.encode(type.fromObject(request)).finish();
    return new Promise((resolve, reject) => {
      if (this.session === null && this.resendTimer === null) this.open(); // the last one ended
      this.unanswered.push({ id: this.nextId, message, resolve, reject });
      // Not written to a session whose status came: its end resends the message or rejects it.
      if (this.writable()) this.session.call.write(message);
    });
  }

  answered(reply) {
    const head = this.unanswered.shift();
    if (!head || head.id !== longToNumber(reply.request_id)) {
      if (head) this.unanswered.unshift(head);
      const { call } = this.session;
      this.ended({ code: grpc.status.INTERNAL, details: `unexpected answer to ${reply.request_id}` });
      call.cancel();
      return;
    }
    this.failingSince = null;
    if (reply.error) head.reject(new StreamlogError({ code: reply.error.code, details: reply.error.message }));
    else {
      head.resolve({
        firstOffset: longToNumber(reply.first_offset),
        lastOffset: longToNumber(reply.last_offset),
        timestampMs: longToNumber(reply.timestamp_ms),
        duplicate: reply.duplicate,
      });
    }
    const waiting = this.room.shift();
    if (waiting) waiting();
  }

  // The current session's call ended, with `status` (null: OK). With a producerId, messages left
  // unanswered by UNAVAILABLE go to a new session after retryMs, for as long as the client's
  // timeoutMs from the first failure with nothing answered since; else they fail with it.
  ended(status) {
    this.session = null;
    if (status && status.code === grpc.status.UNAVAILABLE && this.producerId && this.unanswered.length) {
      const now = Date.now();
      if (this.failingSince === null) this.failingSince = now;
      if (now - this.failingSince < this.client.timeoutMs) {
        this.resendTimer = setTimeout(() => this.reconnect(), this.retryMs);
        return;
      }
    }
    this.failingSince = null;
    const failure = new StreamlogError(status
      || { code: grpc.status.UNAVAILABLE, details: 'the Publish session ended before answering this message' });
    for (const { reject } of this.unanswered.splice(0)) reject(failure);
    for (const waiting of this.room.splice(0)) waiting();
    if (this.closing) this.closing.resolve();
  }

  // Ends the current session and writes every unanswered message again on a new one.
  reconnect() {
    clearTimeout(this.resendTimer);
    this.resendTimer = null;
    const old = this.session;
    this.open();
    if (old) {
      old.call.end(); // half-closed first: grpc-js may not send the cancel of a call with writes queued
      old.call.cancel();
    }
    for (const { message } of this.unanswered) this.session.call.write(message);
    if (this.closing) this.session.call.end();
  }

  // Half-closes the session and resolves once every message is answered (or has failed).
  close() {
    if (!this.closing) {
      let resolve;
      const done = new Promise((r) => { resolve = r; });
      this.closing = { done, resolve };
      if (this.writable()) this.session.call.end();
      else if (this.session === null && this.resendTimer === null) resolve(); // nothing unanswered
      // (else the session's end, or the resend's, resolves it)
    }
    return this.closing.done;
  }
}

module.exports = { Client, Publisher, StreamlogError };
