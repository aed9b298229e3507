// The streams page: one page of stream names (ListStreams), each with its info and append rate.

import { get, seg } from "./api.js";
import { bytes, count, el, problem, retention, sparkline, table } from "./view.js";

const PAGE = 20;

export async function streamsPage(main, params) {
  const prefix = params.get("prefix") || "";
  const tokens = (params.get("pages") || "").split(",").filter(Boolean); // tokens of the pages before
  const listing = await get("/v1/streams", { prefix, page_size: PAGE, page_token: tokens[tokens.length - 1] });
  const names = listing.streams || [];
  const rows = await Promise.all(names.map(row));
  const link = (pages) => `#/?${new URLSearchParams({ prefix, pages: pages.join(",") })}`;
  const filter = el("form", { class: "toolbar", onsubmit: (event) => {
    event.preventDefault();
    location.hash = `#/?${new URLSearchParams({ prefix: event.target.prefix.value })}`;
  } },
  el("label", {}, "Name starts with ", el("input", { name: "prefix", value: prefix, placeholder: "prefix" })),
  el("button", {}, "Filter"));
  main.replaceChildren(
    el("h1", {}, "Streams"),
    filter,
    table(["Stream", "Entries", "First offset", "Next offset", "Size", "Compression", "Retention", "Groups",
      "Appends/s (10 min)"], rows, prefix ? `no stream starts with "${prefix}"` : "no streams yet"),
    el("nav", { class: "pager" },
      tokens.length ? el("a", { href: link(tokens.slice(0, -1)), id: "prev-page" }, "← previous") : "",
      listing.next_page_token ? el("a", { href: link([...tokens, listing.next_page_token]), id: "next-page" }, "next →") : ""),
  );
}

async function row(name) {
  const href = `#/stream/${seg(name)}`;
  try {
    const [{ info }, history] = await Promise.all([
      get(`/v1/streams/${seg(name)}`),
      get(`/v1/streams/${seg(name)}/history`),
    ]);
    const perSecond = history.samples.map((s) => s.appended / (history.interval_ms / 1000));
    const ratio = info.compression_ratio || 1;
    return el("tr", { "data-stream": name },
      el("td", {}, el("a", { href }, name)),
      el("td", { class: "n" }, count(info.entries)),
      el("td", { class: "n" }, count(info.first_offset)),
      el("td", { class: "n" }, count(info.next_offset)),
      el("td", { class: "n" }, bytes(info.bytes_on_disk)),
      el("td", { class: "n" }, ratio > 1 ? `${ratio.toFixed(2)}×` : "none"),
      el("td", {}, retention(info.config)),
      el("td", { class: "n" }, info.groups === undefined ? "?" : count(info.groups)),
      el("td", {}, sparkline(perSecond, { label: `${name} appends per second` })));
  } catch (error) {
    return el("tr", {}, el("td", {}, el("a", { href }, name)), el("td", { colspan: 8 }, problem(error)));
  }
}
