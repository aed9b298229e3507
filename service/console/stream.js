// A stream's page: its entries a page at a time (seek by offset or time, gaps shown as gaps),
// a live tail, its consumer groups, and the admin actions on it (trim, create a group).

import { call, follow, get, seg } from "./api.js";
import {
  bytes, confirmAction, count, el, headerList, num, payload, problem, retention, table, time,
} from "./view.js";

const PAGE = 20;
const FORMATS = ["json", "text", "hex"];
const COLUMNS = ["Offset", "Appended", "Tag", "Headers", "Payload"];
let tail = null; // the AbortController of the live tail, stopped when the page changes

export function leaveStream() {
  if (tail) tail.abort();
  tail = null;
}

export async function streamPage(main, name, params) {
  const format = FORMATS.includes(params.get("format")) ? params.get("format") : "json";
  const { info } = await get(`/v1/streams/${seg(name)}`);
  const first = num(info.first_offset);
  const end = num(info.next_offset);
  const offset = params.has("offset") ? Math.max(num(params.get("offset")), 0) : Math.max(end - PAGE, first);
  const read = await get(`/v1/streams/${seg(name)}/entries`, { offset, count: PAGE });
  const here = (changes) => {
    const next = new URLSearchParams({ offset, format, ...changes });
    return `#/stream/${seg(name)}?${next}`;
  };
  const tailBody = el("tbody", { id: "tail" });
  main.replaceChildren(
    el("p", { class: "crumbs" }, el("a", { href: "#/" }, "Streams"), " / ", name),
    el("h1", {}, name),
    summary(info),
    el("h2", {}, "Entries"),
    controls(name, offset, format, here),
    entriesTable(read, format),
    el("nav", { class: "pager" },
      offset > first ? el("a", { id: "prev-page", href: here({ offset: Math.max(offset - PAGE, first) }) }, "← older") : "",
      num(read.next_offset) < end ? el("a", { id: "next-page", href: here({ offset: num(read.next_offset) }) }, "newer →") : ""),
    el("h2", {}, "Live tail"),
    el("p", {}, el("button", { id: "tail-toggle", onclick: (event) => toggleTail(name, format, tailBody, event.target) },
      "Follow new entries")),
    el("table", {}, el("thead", {}, el("tr", {}, COLUMNS.map((c) => el("th", {}, c)))), tailBody),
    el("h2", {}, "Consumer groups"),
    await groups(name),
    el("h2", {}, "Admin"),
    admin(name, info),
  );
}

function summary(info) {
  const facts = [
    ["Entries", count(info.entries)], ["First offset", count(info.first_offset)],
    ["Next offset", count(info.next_offset)], ["Size on disk", bytes(info.bytes_on_disk)],
    ["Compression", (info.compression_ratio || 1) > 1 ? `${info.compression_ratio.toFixed(2)}×` : "none"],
    ["Retention", retention(info.config)], ["Last append", time(info.last_timestamp_ms) || "never"],
    ["Fsync", (info.effective_fsync || "").replace("FSYNC_POLICY_", "").toLowerCase()],
  ];
  return el("dl", { class: "facts" }, facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))));
}

function controls(name, offset, format, here) {
  const seekOffset = el("form", { class: "toolbar", id: "seek-offset", onsubmit: (event) => {
    event.preventDefault();
    location.hash = here({ offset: event.target.offset.value });
  } }, el("label", {}, "Offset ", el("input", { name: "offset", type: "number", min: 0, value: offset })),
  el("button", {}, "Go"));
  const seekTime = el("form", { class: "toolbar", id: "seek-time", onsubmit: async (event) => {
    event.preventDefault();
    const ms = new Date(event.target.when.value).getTime();
    const found = await get(`/v1/streams/${seg(name)}/seek`, { timestamp_ms: ms });
    location.hash = here({ offset: num(found.offset) });
  } }, el("label", {}, "Time ", el("input", { name: "when", type: "datetime-local", step: 1, required: true })),
  el("button", {}, "Seek"));
  const formats = el("span", { class: "toolbar" }, "Payloads as ",
    FORMATS.map((f) => (f === format ? el("b", {}, f) : el("a", { href: here({ format: f }) }, f))));
  return el("div", { class: "controls" }, seekOffset, seekTime, formats);
}

function entryRow(entry, format) {
  return el("tr", { "data-offset": num(entry.offset) },
    el("td", { class: "n" }, count(entry.offset)),
    el("td", {}, time(entry.timestamp_ms)),
    el("td", {}, entry.tag || ""),
    el("td", {}, headerList(entry.headers)),
    el("td", {}, payload(entry.payload, format)));
}

function gapRow(start, end, why) {
  return el("tr", { class: "gap" }, el("td", { colspan: 5 },
    `offsets ${count(start)} to ${count(end - 1)}: ${count(end - start)} entries ${why}`));
}

function entriesTable(read, format) {
  const rows = [];
  if (read.gap) {
    const why = (read.gap.reason || "").replace("GAP_REASON_", "").toLowerCase();
    rows.push(gapRow(num(read.gap.start_offset), num(read.gap.end_offset), why));
  }
  let previous = null;
  for (const entry of read.entries || []) {
    const at = num(entry.offset);
    if (previous !== null && at > previous + 1) rows.push(gapRow(previous + 1, at, "compacted away"));
    rows.push(entryRow(entry, format));
    previous = at;
  }
  return table(COLUMNS, rows, "no entries here");
}

function toggleTail(name, format, body, button) {
  if (tail) {
    leaveStream();
    button.textContent = "Follow new entries";
    return;
  }
  tail = new AbortController();
  button.textContent = "Stop following";
  body.replaceChildren(el("tr", { class: "muted" }, el("td", { colspan: 5 }, "following: new entries appear here")));
  follow(`/v1/streams/${seg(name)}/events?start=START_POSITION_LATEST`, (batch) => {
    for (const entry of batch.entries || []) body.append(entryRow(entry, format));
  }, tail.signal).catch((error) => {
    if (error.name !== "AbortError") body.append(el("tr", {}, el("td", { colspan: 5 }, problem(error))));
  });
}

async function groups(name) {
  let listing;
  try {
    listing = await get(`/v1/streams/${seg(name)}/groups`);
  } catch (error) {
    return problem(error);
  }
  const rows = (listing.groups || []).map((g) => el("tr", {},
    el("td", {}, el("a", { href: `#/group/${seg(name)}/${seg(g.name)}` }, g.name)),
    el("td", { class: "n" }, count(g.next_offset)),
    el("td", { class: "n" }, g.lag === undefined ? "unknown" : count(g.lag)),
    el("td", { class: "n" }, count(g.pending)),
    el("td", { class: "n" }, count((g.consumers || []).length)),
    el("td", { class: "n" }, count(g.counters?.dead_lettered))));
  return table(["Group", "Position", "Lag", "Pending", "Consumers", "Dead-lettered"], rows, "no consumer groups");
}

function admin(name, info) {
  const result = el("div", { class: "result" });
  const act = async (what, rpc, body) => {
    if (!(await confirmAction(what))) return;
    try {
      await call(rpc, body);
      location.reload();
    } catch (error) {
      result.replaceChildren(problem(error));
    }
  };
  const trim = el("form", { class: "toolbar", id: "trim", onsubmit: (event) => {
    event.preventDefault();
    const value = event.target.value.value;
    act(`Remove the entries of "${name}" before offset ${value}? They cannot be read again.`, "Trim",
      { stream: name, trim_to_offset: value });
  } }, el("label", {}, "Trim: drop entries before offset ",
    el("input", { name: "value", type: "number", min: info.first_offset || 0, max: info.next_offset || 0, required: true })),
  el("button", { class: "danger" }, "Trim…"));
  const create = el("form", { class: "toolbar", id: "create-group", onsubmit: (event) => {
    event.preventDefault();
    const group = event.target.group.value;
    const start = event.target.start.value;
    act(`Create group "${group}" on "${name}", starting at the ${start.toLowerCase()} entry?`, "CreateGroup",
      { stream: name, group, start: `START_POSITION_${start}` });
  } }, el("label", {}, "New group ", el("input", { name: "group", required: true, placeholder: "name" })),
  el("label", {}, " from ", el("select", { name: "start" },
    el("option", { value: "OLDEST" }, "oldest"), el("option", { value: "LATEST" }, "newest"))),
  el("button", {}, "Create…"));
  return el("div", {}, create, trim, result);
}
