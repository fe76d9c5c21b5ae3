// The chat page: talks to this server's OpenAI API (/v1/chat/completions, streamed) as any
// client does. The conversation, the settings and the API key stay in the browser
// (localStorage); the model's text is rendered by markdown.js, as text only.
import { renderMarkdown } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const KEYS = { chat: "tinyllm.chat", settings: "tinyllm.settings", apiKey: "tinyllm.apiKey" };
const SETTINGS = ["system", "temperature", "max-tokens", "schema"];

// Each message: {role, content}, and for an answer reasoning, stats, error, stopped.
let messages = load(KEYS.chat, []);
let model = null; // the served model's name, once /v1/models answered
let controller = null; // the AbortController of the answer streaming in, if any

function load(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function saveChat() {
  localStorage.setItem(KEYS.chat, JSON.stringify(messages));
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function button(label, onClick) {
  const b = element("button", "", label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem(KEYS.apiKey);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The server's error message from a failed response (OpenAI's {"error": {"message"}}).
async function errorMessage(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// --- API key -----------------------------------------------------------------------------

function askForKey(message) {
  $("key-message").textContent = message;
  $("key-form").hidden = false;
  $("key").focus();
}

// Asks /v1/models, which needs the key if the server has one: shows the model, or the form.
async function connect() {
  const response = await fetch("/v1/models", { headers: headers() });
  if (response.status === 401) {
    const had = localStorage.getItem(KEYS.apiKey);
    const why = had ? "The server refused this key" : "This server needs an API key";
    askForKey(`${why}: ${await errorMessage(response)}`);
    return false;
  }
  $("key-form").hidden = true;
  if (response.ok) {
    model = (await response.json()).data[0]?.id ?? null;
    $("model").textContent = model ?? "";
  }
  return true;
}

// --- rendering ---------------------------------------------------------------------------

function statsLine(m) {
  if (m.stopped) return "Stopped.";
  const s = m.stats;
  if (!s) return "";
  return (
    `${s.tokens} tokens · ${s.tokensPerSecond.toFixed(1)} tokens/s · ` +
    `first token ${s.firstTokenSeconds.toFixed(2)} s · ${s.cachedTokens} cached prompt tokens`
  );
}

function userNode(m, i) {
  const node = element("article", "message user");
  node.append(element("div", "content"));
  node.lastChild.append(renderMarkdown(m.content));
  node.append(element("div", "actions"));
  node.lastChild.append(button("Edit", () => editMessage(node, i)));
  return node;
}

function answerNode(m, i) {
  const node = element("article", "message assistant");
  if (m.reasoning) {
    const thinking = element("details", "reasoning");
    thinking.append(element("summary", "", "Thinking"), renderMarkdown(m.reasoning));
    node.append(thinking);
  }
  node.append(element("div", "content"));
  node.lastChild.append(renderMarkdown(m.content));
  if (m.error) node.append(element("p", "error", m.error));
  node.append(element("p", "stats", statsLine(m)));
  if (m !== streaming()) {
    const actions = element("div", "actions");
    actions.append(button("Copy", (e) => copy(m.content, e.target)));
    actions.append(button("Regenerate", () => regenerate(i)));
    node.append(actions);
  }
  return node;
}

function streaming() {
  return controller ? messages[messages.length - 1] : null;
}

function render() {
  const list = $("messages");
  const atBottom = list.scrollHeight - list.scrollTop - list.clientHeight < 40;
  const node = (m, i) => (m.role === "user" ? userNode : answerNode)(m, i);
  list.replaceChildren(...messages.map(node));
  if (atBottom) list.scrollTop = list.scrollHeight;
}

let pending = false; // a render asked for in this frame
function renderSoon() {
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    render();
  });
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// --- talking to the server ---------------------------------------------------------------

function requestBody(history) {
  const body = { messages: [], stream: true, stream_options: { include_usage: true } };
  if (model) body.model = model;
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  for (const m of history) if (m.content) body.messages.push({ role: m.role, content: m.content });
  const temperature = $("temperature").value;
  if (temperature !== "") body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value;
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  const schema = $("schema").value.trim();
  if (schema) {
    let parsed;
    try {
      parsed = JSON.parse(schema);
    } catch (e) {
      throw new Error(`the JSON schema is not JSON: ${e.message}`);
    }
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: parsed } };
  }
  return body;
}

// The JSON events of a server-sent event stream, up to [DONE].
async function* events(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

// Streams an answer to the conversation as it stands (ending with the user's message).
async function generate() {
  const answer = { role: "assistant", content: "", reasoning: "" };
  const history = messages.slice();
  messages.push(answer);
  controller = new AbortController();
  setBusy(true);
  render();
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(requestBody(history)),
      signal: controller.signal,
    });
    if (response.status === 401) {
      messages.pop(); // asked again once the key is in
      askForKey(`The server needs a valid API key: ${await errorMessage(response)}`);
      return;
    }
    if (!response.ok) throw new Error(await errorMessage(response));
    for await (const event of events(response.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const delta = event.choices?.[0]?.delta ?? {};
      if (delta.content || delta.reasoning_content) {
        first ??= performance.now();
        answer.content += delta.content ?? "";
        answer.reasoning += delta.reasoning_content ?? "";
        renderSoon();
      }
    }
    if (usage) {
      const end = performance.now();
      const n = usage.completion_tokens;
      // The decoding rate: the tokens after the first over the time after it.
      const decoding =
        first !== null && n > 1 ? (n - 1) / ((end - first) / 1000) : n / ((end - start) / 1000);
      answer.stats = {
        tokens: n,
        tokensPerSecond: decoding,
        firstTokenSeconds: ((first ?? end) - start) / 1000,
        cachedTokens: usage.prompt_tokens_details?.cached_tokens ?? 0,
      };
    }
  } catch (e) {
    if (e.name === "AbortError") answer.stopped = true;
    else answer.error = `Error: ${e.message}`;
  } finally {
    controller = null;
    setBusy(false);
    saveChat();
    render();
  }
}

function send(text) {
  messages.push({ role: "user", content: text });
  saveChat();
  generate();
}

function editMessage(node, i) {
  if (controller) return;
  const box = element("textarea", "edit");
  box.value = messages[i].content;
  const save = button("Send", () => {
    if (!box.value.trim()) return;
    messages = messages.slice(0, i); // what followed answered the old message
    send(box.value);
  });
  node.replaceChildren(box, element("div", "actions"));
  node.lastChild.append(save, button("Cancel", render));
  box.focus();
}

function regenerate(i) {
  if (controller) return;
  messages = messages.slice(0, i);
  generate();
}

async function copy(text, target) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // No clipboard API off a secure context (http:// to another machine): select and copy.
    const area = element("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  target.textContent = "Copied";
}

// --- wiring ------------------------------------------------------------------------------

function restoreSettings() {
  const saved = load(KEYS.settings, {});
  for (const id of SETTINGS) {
    $(id).value = saved[id] ?? "";
    $(id).addEventListener("input", () => {
      const now = Object.fromEntries(SETTINGS.map((s) => [s, $(s).value]));
      localStorage.setItem(KEYS.settings, JSON.stringify(now));
    });
  }
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value;
  if (controller || !text.trim()) return;
  $("prompt").value = "";
  send(text);
});

$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});

$("stop").addEventListener("click", () => controller?.abort());

$("new-chat").addEventListener("click", () => {
  controller?.abort();
  messages = [];
  saveChat();
  render();
});

$("key-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  localStorage.setItem(KEYS.apiKey, $("key").value.trim());
  $("key").value = "";
  const last = messages[messages.length - 1];
  if ((await connect()) && last?.role === "user") generate(); // the message the 401 refused
});

$("forget-key").addEventListener("click", () => {
  localStorage.removeItem(KEYS.apiKey);
  connect();
});

restoreSettings();
render();
connect();
