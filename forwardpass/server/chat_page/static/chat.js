// The forwardpass chat page: plain JavaScript over the OpenAI API of the same server (no libraries).
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];           // OpenAI messages of this conversation (user / assistant turns)
let controller = null;        // AbortController of the reply being streamed

function apiKey() { return localStorage.getItem("forwardpass-api-key") || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey()) h.Authorization = "Bearer " + apiKey();
  return h;
}

async function api(path, options = {}) {
  let r = await fetch(path, { ...options, headers: headers() });
  if (r.status === 401) {
    const key = prompt("This server needs an API key (FORWARDPASS_API_KEY):");
    if (key) {
      localStorage.setItem("forwardpass-api-key", key.trim());
      r = await fetch(path, { ...options, headers: headers() });
    }
  }
  return r;
}

function showError(text) {
  const el = $("error");
  el.textContent = text || "";
  el.hidden = !text;
}

async function errorText(r) {
  try {
    const body = await r.json();
    return (body.error && body.error.message) || JSON.stringify(body);
  } catch (e) {
    return r.status + " " + r.statusText;
  }
}

async function loadModels() {
  const select = $("model");
  try {
    const r = await api("/v1/models");
    if (!r.ok) { showError("GET /v1/models: " + await errorText(r)); return; }
    const body = await r.json();
    select.innerHTML = "";
    for (const m of body.data) {
      if (m.kind && m.kind !== "generate") continue;  // a server of several models: only the chat ones
      const opt = document.createElement("option");
      opt.value = m.id;
      opt.textContent = m.parent ? m.id + " (adapter)" : m.id;
      select.appendChild(opt);
    }
    const saved = localStorage.getItem("forwardpass-model");
    if (saved && [...select.options].some((o) => o.value === saved)) select.value = saved;
  } catch (e) {
    showError("cannot reach the server: " + e);
  }
}

function addMessage(role, text) {
  $("hint").hidden = true;
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  div.append(label, body);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = on;
}

// Server-sent events from a fetch body: "data: {...}" lines, blank-line separated, ending in [DONE].
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  showError("");
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const div = addMessage("assistant", "");
  div.classList.add("streaming");
  const out = div.querySelector(".text");
  const system = $("system").value.trim();
  const model = $("model").value;
  localStorage.setItem("forwardpass-model", model);
  const body = {
    model,
    messages: (system ? [{ role: "system", content: system }] : []).concat(history),
    stream: true,
    stream_options: { include_usage: true },
    temperature: parseFloat($("temperature").value),
    max_tokens: parseInt($("max-tokens").value, 10),
  };
  controller = new AbortController();
  busy(true);
  const start = performance.now();
  let first = null, reply = "", usage = null, stopped = false;
  try {
    const r = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: controller.signal });
    if (!r.ok) throw new Error(await errorText(r));
    for await (const data of sseEvents(r)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const delta = (choice.delta && choice.delta.content) || "";
        if (delta) {
          if (first === null) first = performance.now();
          reply += delta;
          out.textContent = reply;
          div.scrollIntoView({ block: "end" });
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      stopped = true;
    } else {
      showError(String(e.message || e));
    }
  } finally {
    controller = null;
    div.classList.remove("streaming");
    busy(false);
    $("input").focus();
  }
  if (stopped) {
    const s = document.createElement("span");
    s.className = "stopped";
    s.textContent = " [stopped]";
    div.appendChild(s);
  }
  history.push({ role: "assistant", content: reply });
  div.dataset.done = "1";
  const secs = (performance.now() - start) / 1000;
  const ttft = first === null ? "–" : ((first - start) / 1000).toFixed(2) + " s";
  const tokens = usage ? usage.completion_tokens : null;
  $("stats").textContent = "last reply: first token " + ttft + ", " + secs.toFixed(2) + " s total"
    + (tokens ? ", " + tokens + " tokens (" + (tokens / secs).toFixed(1) + " tok/s)" : "");
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if (!text.trim() || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (controller) controller.abort(); });
$("reset").addEventListener("click", () => {
  if (controller) controller.abort();
  history.length = 0;
  for (const m of [...document.querySelectorAll(".msg")]) m.remove();
  $("hint").hidden = false;
  $("stats").textContent = "";
  showError("");
});

loadModels();
