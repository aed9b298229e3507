// Calls to the server's HTTP API: JSON in and out, the bearer token from sessionStorage,
// refusals as ApiError (HTTP status, gRPC status name, message), and Server-Sent Events
// read with fetch (EventSource cannot send an Authorization header).

const TOKEN_KEY = "streamlog-token";

export class ApiError extends Error {
  constructor(httpStatus, status, message) {
    super(message);
    this.httpStatus = httpStatus;
    this.status = status;
  }
  get unauthenticated() { return this.httpStatus === 401; }
  get denied() { return this.httpStatus === 403; }
}

export const token = {
  get: () => sessionStorage.getItem(TOKEN_KEY),
  set: (value) => sessionStorage.setItem(TOKEN_KEY, value),
  clear: () => sessionStorage.removeItem(TOKEN_KEY),
};

function headers(extra = {}) {
  const sent = { ...extra };
  const value = token.get();
  if (value) sent.Authorization = `Bearer ${value}`;
  return sent;
}

async function answer(response) {
  const text = await response.text();
  let body = {};
  try { body = text ? JSON.parse(text) : {}; } catch { body = { message: text }; }
  if (!response.ok) {
    throw new ApiError(response.status, body.status || String(response.status), body.message || response.statusText);
  }
  return body;
}

export const seg = (name) => encodeURIComponent(name);

export async function get(path, query = {}) {
  const params = new URLSearchParams();
  for (const [key, value] of Object.entries(query)) {
    if (value !== undefined && value !== null && value !== "") params.append(key, String(value));
  }
  const url = params.size ? `${path}?${params}` : path;
  return answer(await fetch(url, { headers: headers() }));
}

export async function call(rpc, body) {
  const response = await fetch(`/v1/${rpc}`, {
    method: "POST",
    headers: headers({ "Content-Type": "application/json" }),
    body: JSON.stringify(body),
  });
  return answer(response);
}

// Follows a Server-Sent Events route: onEvent(data) per reply; resolves when the stream ends,
// rejects with ApiError on a refusal or an `error` event. `signal` (an AbortSignal) stops it.
export async function follow(path, onEvent, signal) {
  const response = await fetch(path, { headers: headers({ Accept: "text/event-stream" }), signal });
  if (!response.ok) await answer(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let kind = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data.push(line.slice(6));
      }
      if (!data.length) continue;
      const parsed = JSON.parse(data.join("\n"));
      if (kind === "error") throw new ApiError(0, parsed.status, parsed.message);
      onEvent(parsed);
    }
  }
}

// Whether the server runs in a cluster: DescribeCluster then names it (a single server
// answers as one node, with no cluster name).
let clusterKnown;
export async function hasCluster() {
  if (clusterKnown === undefined) {
    clusterKnown = Boolean((await get("/v1/cluster")).cluster_name);
  }
  return clusterKnown;
}
