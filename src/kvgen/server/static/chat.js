// kvgen chat page: streams replies from /v1/chat/completions (server-sent events), keeps the
// conversation in memory, and shows tokens/s (completion tokens from the usage chunk / seconds
// since the first token). No build step, nothing fetched from outside this server.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = [];  // {role, content} as the API takes them
let modelName = "default";
let controller = null;
let chatId = 0;  // "New chat" counts up: a stream it aborted must not touch the new conversation

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "message " + role;
  div.textContent = text;
  $("messages").appendChild(div);
  $("messages").scrollTop = $("messages").scrollHeight;
  return div;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error((body.error && body.error.message) || `HTTP ${r.status} ${r.statusText}`);
    if (body.data && body.data.length) modelName = body.data[0].id;
    $("model").textContent = "model: " + modelName;
  } catch (e) {  // e.g. a 401: the server wants an API key
    $("model").textContent = "model: unknown (" + e.message + ")";
  }
}

// Parse an SSE byte stream into the JSON payloads of its `data:` lines; stops at [DONE].
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    model: modelName,
    messages: messages.concat(conversation),
    stream: true,
    stream_options: { include_usage: true },
  };
  // an empty field leaves the setting to the server (the model's default), where Number("") made it 0: greedy
  for (const [id, name] of [["temperature", "temperature"], ["max-tokens", "max_tokens"]]) {
    const value = $(id).value.trim();
    if (value !== "") body[name] = Number(value);
  }
  return body;
}

async function send(text) {
  conversation.push({ role: "user", content: text });
  addMessage("user", text);
  const bubble = addMessage("assistant", "");
  bubble.dataset.state = "streaming";
  controller = new AbortController();
  const chat = chatId;
  $("send").disabled = true;
  $("stop").disabled = false;
  const start = performance.now();
  let firstToken = null, reply = "", tokens = 0, chunks = 0;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error((body.error && body.error.message) || `HTTP ${r.status} ${r.statusText}`.trim());
    }
    for await (const chunk of events(r)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) tokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices || []) {
        const piece = (choice.delta && choice.delta.content) || "";
        if (!piece) continue;
        if (firstToken === null) firstToken = performance.now();
        reply += piece;
        chunks += 1;
        bubble.textContent = reply;
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    }
    showStats(start, firstToken, tokens || chunks);
  } catch (e) {
    if (e.name !== "AbortError") {
      bubble.classList.add("error");
      reply = reply || "";
      bubble.textContent = reply + (reply ? "\n" : "") + "[error] " + e.message;
    }
  } finally {
    if (chat === chatId) {  // else "New chat" aborted this turn and has cleared it already
      if (reply) conversation.push({ role: "assistant", content: reply });
      else conversation.pop();  // nothing came back: forget the unanswered turn
    }
    bubble.dataset.state = "done";
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
}

function showStats(start, firstToken, tokens) {
  const end = performance.now();
  const ttft = firstToken === null ? 0 : (firstToken - start) / 1000;
  const seconds = firstToken === null ? 0 : (end - firstToken) / 1000;
  const rate = seconds > 0 && tokens > 1 ? ((tokens - 1) / seconds).toFixed(1) : "–";
  $("stats").textContent = `${tokens} tokens · ${rate} tokens/s · first token after ${ttft.toFixed(2)} s`;
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  // an input method's Enter confirms its text (keyCode 229 where isComposing is already false), not the message
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing && e.keyCode !== 229) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  chatId += 1;
  conversation.length = 0;
  $("messages").textContent = "";
  $("stats").textContent = "";
});
$("api-key").addEventListener("change", loadModel);
loadModel();
