// The cluster page: what DescribeCluster answers (nodes, leaders, replicas, in-sync sets,
// replication lag), drawn from the reply itself: each list of records becomes a table, so the
// page follows the RPC's fields as they are. A single server (no cluster name) says so.

import { get, hasCluster } from "./api.js";
import { el, table } from "./view.js";

function cell(value) {
  if (Array.isArray(value)) return value.map(cell).join(", ");
  if (value && typeof value === "object") return Object.entries(value).map(([k, v]) => `${k}: ${cell(v)}`).join("; ");
  return String(value);
}

export async function clusterPage(main) {
  if (!(await hasCluster())) {
    main.replaceChildren(el("h1", {}, "Cluster"),
      el("p", { id: "single-node" }, "This is a single node: it runs without a cluster, and holds every stream itself."));
    return;
  }
  const reply = await get("/v1/cluster");
  const sections = [];
  for (const [name, value] of Object.entries(reply)) {
    if (Array.isArray(value) && value.length && typeof value[0] === "object") {
      const columns = [...new Set(value.flatMap((row) => Object.keys(row)))];
      // The JSON mapping leaves out fields at their default: a flag another row has is false here.
      const flags = new Set(columns.filter((c) => value.some((row) => typeof row[c] === "boolean")));
      const shown = (row, c) => (row[c] !== undefined ? cell(row[c]) : flags.has(c) ? "false" : "");
      sections.push(el("h2", {}, name),
        table(columns, value.map((row) => el("tr", {}, columns.map((c) => el("td", {}, shown(row, c)))))));
    } else {
      sections.push(el("p", {}, el("b", {}, `${name}: `), cell(value)));
    }
  }
  main.replaceChildren(el("h1", {}, "Cluster"), ...sections);
}
