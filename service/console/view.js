// Building the page: elements, numbers, times, payloads, charts, and the shared panels
// (refusals, errors, confirmations). No framework: a page is rebuilt from its data.

export function el(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

export const num = (value) => Number(value ?? 0);
export const count = (value) => num(value).toLocaleString("en-US");

export function bytes(value) {
  let n = num(value);
  for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
    if (n < 1024 || unit === "TiB") return `${unit === "B" ? n : n.toFixed(1)} ${unit}`;
    n /= 1024;
  }
  return "";
}

export function time(ms) {
  if (!num(ms)) return "";
  const date = new Date(num(ms));
  return date.toISOString().replace("T", " ").replace("Z", " UTC");
}

export function duration(ms) {
  const s = num(ms) / 1000;
  if (s < 1) return `${num(ms)} ms`;
  if (s < 120) return `${s.toFixed(1)} s`;
  if (s < 7200) return `${(s / 60).toFixed(1)} min`;
  return `${(s / 3600).toFixed(1)} h`;
}

// A stream's retention, as its config says it.
export function retention(config = {}) {
  const parts = [];
  if (config.max_entries) parts.push(`${count(config.max_entries)} entries`);
  if (config.max_age_ms) parts.push(`${duration(config.max_age_ms)}`);
  if (config.max_bytes) parts.push(bytes(config.max_bytes));
  if (config.compaction) parts.push("compacted");
  return parts.length ? parts.join(", ") : "forever";
}

// ---------------------------------------------------------------- payloads

export function decode(base64) {
  const binary = atob(base64 || "");
  const out = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) out[i] = binary.charCodeAt(i);
  return out;
}

const utf8 = new TextDecoder("utf-8", { fatal: true });

function asText(data) {
  try { return utf8.decode(data); } catch { return null; }
}

export function hex(data) {
  const lines = [];
  for (let i = 0; i < data.length; i += 16) {
    const row = Array.from(data.slice(i, i + 16), (b) => b.toString(16).padStart(2, "0"));
    lines.push(`${i.toString(16).padStart(6, "0")}  ${row.join(" ")}`);
  }
  return lines.join("\n");
}

// A payload as the user asked: "json" (pretty, else text), "text" (else hex) or "hex".
export function payload(base64, format) {
  const data = decode(base64);
  if (!data.length) return el("span", { class: "muted" }, "(empty)");
  const text = format === "hex" ? null : asText(data);
  if (format === "json" && text !== null) {
    try { return el("pre", { class: "json" }, JSON.stringify(JSON.parse(text), null, 2)); } catch { /* text */ }
  }
  if (text !== null) return el("pre", {}, text);
  return el("pre", { class: "hex" }, hex(data));
}

export function headerList(map = {}) {
  const keys = Object.keys(map).sort();
  if (!keys.length) return "";
  return el("ul", { class: "headers" },
    keys.map((key) => el("li", {}, el("b", {}, key), "=", asText(decode(map[key])) ?? hex(decode(map[key])))));
}

// ---------------------------------------------------------------- charts

// A small line chart of `values` (numbers, or null for "unknown"), as inline SVG.
export function sparkline(values, { width = 160, height = 32, label = "" } = {}) {
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("class", "chart");
  svg.setAttribute("role", "img");
  svg.setAttribute("aria-label", label);
  const known = values.filter((v) => v !== null);
  if (!known.length) {
    const text = document.createElementNS(svg.namespaceURI, "text");
    text.setAttribute("x", 4);
    text.setAttribute("y", height / 2 + 4);
    text.textContent = values.length ? "unknown" : "no samples yet";
    svg.append(text);
    return svg;
  }
  const top = Math.max(...known, 1);
  const step = values.length > 1 ? width / (values.length - 1) : width;
  let path = "";
  let pen = false;
  values.forEach((v, i) => {
    if (v === null) { pen = false; return; }
    const x = (i * step).toFixed(1);
    const y = (height - 2 - (v / top) * (height - 4)).toFixed(1);
    path += `${pen ? "L" : "M"}${x},${y} `;
    pen = true;
  });
  const line = document.createElementNS(svg.namespaceURI, "path");
  line.setAttribute("d", path.trim());
  const title = document.createElementNS(svg.namespaceURI, "title");
  title.textContent = `${label}: max ${top.toLocaleString("en-US")}, last ${known[known.length - 1].toLocaleString("en-US")}`;
  svg.append(title, line);
  return svg;
}

// ---------------------------------------------------------------- panels

export function problem(error) {
  if (error && error.denied) {
    return el("div", { class: "refusal", role: "alert" },
      el("strong", {}, "Not allowed. "), "Your token may not see this: ", error.message);
  }
  return el("div", { class: "error", role: "alert" },
    el("strong", {}, `${error.status || "Error"}: `), error.message || String(error));
}

// Asks before an admin action; resolves true when confirmed.
export function confirmAction(text) {
  const dialog = document.getElementById("confirm");
  document.getElementById("confirm-text").textContent = text;
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok"), { once: true });
    dialog.showModal();
  });
}

export function table(columns, rows, empty = "nothing here") {
  return el("table", {},
    el("thead", {}, el("tr", {}, columns.map((c) => el("th", {}, c)))),
    el("tbody", {}, rows.length ? rows : el("tr", {}, el("td", { colspan: columns.length, class: "muted" }, empty))));
}
