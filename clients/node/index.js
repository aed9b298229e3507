'use strict';
// A small streamlog client for Node.js: @grpc/grpc-js with @grpc/proto-loader, which
// reads protos/streamlog/v1/streamlog.proto at run time (no generated code to keep in
// step). Promises for unary calls, an async iterator for subscriptions.
//
// Offsets are int64 on the wire. They are loaded as strings (so nothing is rounded)
// and handed to you as Numbers, which hold every integer below 2^53; a larger offset
// throws a RangeError rather than silently losing precision.

const path = require('node:path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

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

class Client {
  // address: "host:port". options: token (sent as `authorization: Bearer ...`),
  // rootCerts / certChain / privateKey (Buffers; any of them turns TLS on), timeoutMs.
  constructor(address, options = {}) {
    const Service = loadService();
    const tls = options.rootCerts || options.certChain || options.tls;
    const credentials = tls
      ? grpc.credentials.createSsl(options.rootCerts || null, options.privateKey || null,
        options.certChain || null)
      : grpc.credentials.createInsecure();
    this.stub = new Service(address, credentials);
    this.token = options.token || null;
    this.timeoutMs = options.timeoutMs || 30000;
  }

  close() {
    this.stub.close();
  }

  metadata() {
    const metadata = new grpc.Metadata();
    if (this.token) metadata.set('authorization', `Bearer ${this.token}`);
    return metadata;
  }

  unary(method, request, waitMs = 0) {
    const deadline = new Date(Date.now() + this.timeoutMs + waitMs);
    return new Promise((resolve, reject) => {
      this.stub[method](request, this.metadata(), { deadline }, (error, reply) => {
        if (error) reject(new StreamlogError(error));
        else resolve(reply);
      });
    });
  }

  // payloads: Buffers/strings (the fast `payloads` form), or entries {payload, tag, headers}.
  // options: producerId + producerSequence (idempotent), expectedNextOffset (conditional).
  async append(stream, items, options = {}) {
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
    const reply = await this.unary('Append', request);
    return {
      firstOffset: toNumber(reply.first_offset),
      lastOffset: toNumber(reply.last_offset),
      timestampMs: toNumber(reply.timestamp_ms),
      duplicate: reply.duplicate,
    };
  }

  async read(stream, offset = 0, options = {}) {
    const request = {
      stream, offset: String(offset), count: options.count || 0, block_ms: options.blockMs || 0,
      reverse: Boolean(options.reverse),
    };
    return toBatch(await this.unary('Read', request, options.blockMs || 0));
  }

  // Follows a stream: `for await (const batch of client.subscribe('s', {start: 'oldest'}))`.
  // start: an offset, 'oldest' or 'latest'. Breaking out of the loop cancels the call.
  subscribe(stream, options = {}) {
    const start = options.start === undefined ? 'oldest' : options.start;
    const request = { stream, count: options.count || 0 };
    if (start === 'oldest') request.start = 'START_POSITION_OLDEST';
    else if (start === 'latest') request.start = 'START_POSITION_LATEST';
    else Object.assign(request, { start: 'START_POSITION_OFFSET', offset: String(start) });
    return this.follow(this.stub.Subscribe(request, this.metadata()));
  }

  subscribeGroup(stream, group, consumer, options = {}) {
    const request = { stream, group, consumer, count: options.count || 0 };
    return this.follow(this.stub.Subscribe(request, this.metadata()));
  }

  async* follow(call) {
    try {
      for await (const reply of call) yield toBatch(reply);
    } catch (error) {
      if (error.code !== grpc.status.CANCELLED) throw new StreamlogError(error);
    } finally {
      call.cancel();
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

module.exports = { Client, StreamlogError };
