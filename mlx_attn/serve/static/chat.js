// The chat page: streams /v1/chat/completions. Model output is only ever
// set as text (textContent), never parsed as HTML.
"use strict";
const log = document.getElementById("log");
const input = document.getElementById("input");
const form = document.getElementById("form");
const stopButton = document.getElementById("stop");
const sendButton = document.getElementById("send");
const speed = document.getElementById("speed");
const history = [];
let controller = null;

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  log.appendChild(div);
  div.scrollIntoView({block: "end"});
  return div;
}

function headers() {
  const h = {"Content-Type": "application/json"};
  const key = document.getElementById("api-key").value;
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModel() {
  try {
    const response = await fetch("/v1/models", {headers: headers()});
    if (response.ok) document.getElementById("model").textContent = (await response.json()).data[0].id;
  } catch (e) { /* the name is decoration */ }
}

async function send(text) {
  history.push({role: "user", content: text});
  addMessage("user", text);
  const reply = addMessage("assistant", "");
  controller = new AbortController();
  stopButton.disabled = false;
  sendButton.disabled = true;
  let content = "", chunks = 0, first = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        messages: history, stream: true,
        max_tokens: Number(document.getElementById("max-tokens").value),
        temperature: Number(document.getElementById("temperature").value),
      }),
    });
    if (!response.ok) {
      const body = await response.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || response.statusText);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, {stream: true});
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices || []) {
          const piece = choice.delta && choice.delta.content;
          if (!piece) continue;
          if (first === null) first = performance.now();
          chunks += 1;
          content += piece;
          reply.textContent = content;
        }
        if (first !== null && chunks > 1) {
          const seconds = (performance.now() - first) / 1000;
          speed.textContent = (seconds > 0 ? ((chunks - 1) / seconds).toFixed(1) : "-") + " tokens/s";
        }
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") addMessage("error", String(error.message || error));
  } finally {
    history.push({role: "assistant", content: content});
    controller = null;
    stopButton.disabled = true;
    sendButton.disabled = false;
  }
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
});
input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); form.requestSubmit(); }
});
stopButton.addEventListener("click", () => { if (controller) controller.abort(); });
document.getElementById("clear").addEventListener("click", () => { history.length = 0; log.textContent = ""; });
loadModel();
