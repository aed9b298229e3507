// The console: routes (#/, #/stream/NAME, #/group/STREAM/GROUP, #/cluster), sign-in with a
// token when the server asks for one, and the refusal a token without rights gets.

import { hasCluster, token } from "./api.js";
import { clusterPage } from "./cluster.js";
import { groupPage } from "./group.js";
import { leaveStream, streamPage } from "./stream.js";
import { streamsPage } from "./streams.js";
import { el, problem } from "./view.js";

const main = document.getElementById("main");

function signIn(message) {
  main.replaceChildren(el("form", { class: "signin", id: "signin", onsubmit: (event) => {
    event.preventDefault();
    token.set(event.target.token.value.trim());
    render();
  } },
  el("h1", {}, "Sign in"),
  el("p", {}, message),
  el("label", {}, "Bearer token ", el("input", { name: "token", type: "password", autocomplete: "off", required: true })),
  el("button", {}, "Sign in")));
}

function who() {
  const slot = document.getElementById("who");
  slot.replaceChildren(token.get()
    ? el("button", { id: "signout", onclick: () => { token.clear(); render(); } }, "Sign out")
    : "");
}

async function render() {
  leaveStream();
  who();
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  const params = new URLSearchParams(query);
  document.querySelectorAll("nav a").forEach((a) => a.classList.toggle("here", a.dataset.nav === (parts[0] || "streams")));
  main.setAttribute("aria-busy", "true");
  try {
    if (parts[0] === "stream" && parts.length === 2) await streamPage(main, parts[1], params);
    else if (parts[0] === "group" && parts.length === 3) await groupPage(main, parts[1], parts[2], params);
    else if (parts[0] === "cluster") await clusterPage(main);
    else await streamsPage(main, params);
  } catch (error) {
    if (error.unauthenticated) {
      signIn(token.get() ? `The server refused this token: ${error.message}` : "This server needs a token to show its streams.");
    } else {
      main.replaceChildren(problem(error));
    }
  } finally {
    main.setAttribute("aria-busy", "false");
  }
}

window.addEventListener("hashchange", render);
render();
hasCluster().then((yes) => { document.getElementById("nav-cluster").hidden = !yes; }, () => {});
