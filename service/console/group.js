// A consumer group's page: position, lag (or "unknown"), consumers, counters, lag over time,
// its pending entries a page at a time, and the admin actions (set its offset, delete it).

import { call, get, seg } from "./api.js";
import { confirmAction, count, duration, el, num, problem, sparkline, table, time } from "./view.js";

const PAGE = 50;

export async function groupPage(main, stream, name, params) {
  const base = `/v1/streams/${seg(stream)}/groups/${seg(name)}`;
  const starts = (params.get("pages") || "").split(",").filter(Boolean).map(Number); // earlier pages
  const start = starts.length ? starts[starts.length - 1] : 0;
  const [{ group }, pending, history] = await Promise.all([
    get(base), get(`${base}/pending`, { start_offset: start, count: PAGE }), get(`${base}/history`),
  ]);
  const rows = pending.entries || [];
  const link = (pages) => `#/group/${seg(stream)}/${seg(name)}?${new URLSearchParams({ pages: pages.join(",") })}`;
  const last = rows.length ? num(rows[rows.length - 1].offset) : null;
  main.replaceChildren(
    el("p", { class: "crumbs" }, el("a", { href: "#/" }, "Streams"), " / ",
      el("a", { href: `#/stream/${seg(stream)}` }, stream), " / ", name),
    el("h1", {}, `Group ${name}`),
    facts(group, pending),
    el("div", { class: "charts" },
      chart("Lag", history.samples.map((s) => s.lag), history.interval_ms, "lag-chart"),
      chart("Pending", history.samples.map((s) => s.pending), history.interval_ms, "pending-chart")),
    el("h2", {}, "Consumers"),
    consumers(group),
    el("h2", {}, "Counters"),
    counters(group),
    el("h2", {}, `Pending entries (${count(pending.count)})`),
    table(["Offset", "Owner", "Idle", "Deliveries", "Redelivery due"], rows.map((p) => el("tr", { "data-offset": num(p.offset) },
      el("td", { class: "n" }, count(p.offset)),
      el("td", {}, p.consumer || el("span", { class: "muted" }, "released")),
      el("td", { class: "n" }, duration(p.idle_ms)),
      el("td", { class: "n" }, count(p.delivery_count)),
      el("td", {}, p.due_ms ? time(p.due_ms) : ""))), "nothing pending"),
    el("nav", { class: "pager" },
      starts.length ? el("a", { id: "prev-page", href: link(starts.slice(0, -1)) }, "← lower offsets") : "",
      rows.length === PAGE && last !== null ? el("a", { id: "next-page", href: link([...starts, last + 1]) }, "higher offsets →") : ""),
    el("h2", {}, "Admin"),
    admin(stream, name, group),
  );
}

function facts(group, pending) {
  const list = [
    ["Position", count(group.next_offset)],
    ["Lag", group.lag === undefined ? "unknown" : count(group.lag)],
    ["Pending", count(group.pending)],
    ["Released (awaiting redelivery)", count(pending.released)],
    ["Scheduled (delayed)", count(group.scheduled)],
    ["Entries read", count(group.entries_read)],
    ["Dead-letter stream", group.config?.dead_letter_stream || "none"],
    ["Last active", time(group.active_ms) || "never"],
  ];
  return el("dl", { class: "facts", id: "group-facts" }, list.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", { "data-fact": k }, v))));
}

function chart(label, values, intervalMs, id) {
  const known = values.filter((v) => v !== null);
  const now = known.length ? known[known.length - 1] : null;
  return el("figure", { id },
    sparkline(values, { width: 320, height: 60, label }),
    el("figcaption", {}, `${label} over the last ${Math.round((values.length * intervalMs) / 60000)} min`,
      now === null ? "" : ` (now ${count(now)})`));
}

function consumers(group) {
  const now = Date.now();
  return table(["Consumer", "Pending", "Seen", "Last got entries"], (group.consumers || []).map((c) => el("tr", {},
    el("td", {}, c.name),
    el("td", { class: "n" }, count(c.pending)),
    el("td", {}, `${duration(now - num(c.seen_ms))} ago`),
    el("td", {}, c.active_ms ? `${duration(now - num(c.active_ms))} ago` : "never"))), "no consumers yet");
}

function counters(group) {
  const c = group.counters || {};
  const names = ["delivered", "redelivered", "acked", "ack_unknown", "expired", "dead_lettered", "evicted"];
  return el("dl", { class: "facts" }, names.map((n) => el("div", {}, el("dt", {}, n.replace("_", " ")), el("dd", {}, count(c[n])))));
}

function admin(stream, name, group) {
  const result = el("div", { class: "result" });
  const act = async (what, rpc, body, after) => {
    if (!(await confirmAction(what))) return;
    try {
      await call(rpc, body);
      after();
    } catch (error) {
      result.replaceChildren(problem(error));
    }
  };
  const move = el("form", { class: "toolbar", id: "set-offset", onsubmit: (event) => {
    event.preventDefault();
    const offset = event.target.offset.value;
    act(`Move group "${name}" to offset ${offset}? Entries before it are skipped; pending entries stay pending.`,
      "SetGroupOffset", { stream, group: name, offset }, () => location.reload());
  } }, el("label", {}, "Set position to offset ",
    el("input", { name: "offset", type: "number", min: 0, value: num(group.next_offset), required: true })),
  el("button", {}, "Set…"));
  const remove = el("button", { class: "danger", id: "delete-group", onclick: () => act(
    `Delete group "${name}" with its consumers and ${count(group.pending)} pending entries?`,
    "DeleteGroup", { stream, group: name }, () => { location.hash = `#/stream/${seg(stream)}`; }) }, "Delete group…");
  return el("div", {}, move, el("p", {}, remove), result);
}
