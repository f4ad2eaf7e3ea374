// The chat page (GET /): conversations with this server's models and LoRA adapters, streamed from
// POST v1/chat/completions (server-sent events read here) and shown as sanitised Markdown. The
// conversations and settings live in this browser's localStorage.
import { $, ApiError, api, errorText, keyButton, note, vendor } from "./common.js";

const STORE = "splitserve.chat";
const NUMBERS = ["temperature", "top_p", "max_tokens", "seed"];
const FIELDS = [...NUMBERS, "tools", "tool_choice", "json"];
const PLAIN = "Answers are shown as plain text, not Markdown";

const state = {
  conversations: [], // {id, title, model, system, messages: [{role, content, images?, reasoning?, tool_calls?, stats?}]}
  current: null,
  settings: {},
  attachments: [], // data: URLs for the next message
  controller: null, // the AbortController of the answer being streamed
  streaming: null, // that answer's message
  markdown: null, // text -> sanitised HTML, once marked and DOMPurify are loaded
};

// --- storage ----------------------------------------------------------------------------------
function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE)) ?? {};
    for (const key of ["conversations", "current", "settings"]) if (saved[key] != null) state[key] = saved[key];
  } catch {
    note("The saved conversations could not be read; starting afresh.");
  }
}

function save() {
  const { conversations, current, settings } = state;
  try {
    localStorage.setItem(STORE, JSON.stringify({ conversations, current, settings }));
  } catch {
    note("This browser's storage is full: the latest changes are not saved (images take room; export and delete old conversations).");
  }
}

const conversation = () => state.conversations.find((c) => c.id === state.current);

function newConversation() {
  const conv = { id: crypto.randomUUID?.() ?? String(Date.now()), title: "New chat", model: $("model").value, system: "", messages: [] };
  state.conversations.unshift(conv);
  state.current = conv.id;
  return conv;
}

// --- models -----------------------------------------------------------------------------------
async function loadModels() {
  const select = $("model");
  try {
    const response = await api("v1/models");
    if (!response.ok) throw new ApiError(response.status, await errorText(response));
    const cards = (await response.json()).data ?? [];
    select.replaceChildren(
      ...cards.map((card) => new Option(card.parent ? `${card.id} (LoRA of ${card.parent})` : card.id, card.id)),
    );
    const wanted = conversation()?.model || state.settings.model;
    if (cards.some((c) => c.id === wanted)) select.value = wanted;
  } catch (err) {
    select.replaceChildren(new Option("(no model list)", ""));
    note(`The models could not be listed: ${err.message}`, "error");
  }
}

// --- rendering --------------------------------------------------------------------------------
function renderMarkdown(el, text) {
  if (state.markdown) el.innerHTML = state.markdown(text);
  else el.textContent = text;
  el.classList.toggle("plain", !state.markdown);
}

function element(tag, className, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  return el;
}

function messageView(msg) {
  const li = element("li", `message ${msg.role}`);
  if (msg.role === "user") {
    for (const url of msg.images ?? []) li.append(Object.assign(element("img", "attached"), { src: url, alt: "attached image" }));
    li.append(element("div", "text plain", msg.content));
    return li;
  }
  const reasoning = element("details", "reasoning");
  reasoning.append(element("summary", "", "Reasoning"), element("div", "text plain"));
  li.append(reasoning, element("div", "text content"), element("div", "tool-calls"), element("div", "stats"));
  li.msg = msg;
  updateAnswer(li, msg);
  return li;
}

/** Bring an answer's view up to date with its message (called once per frame while it streams). */
function updateAnswer(li, msg) {
  const [reasoning, content, tools, stats] = li.children;
  reasoning.hidden = !msg.reasoning;
  reasoning.lastChild.textContent = msg.reasoning ?? "";
  if (content.dataset.shown !== msg.content) {
    renderMarkdown(content, msg.content ?? "");
    content.dataset.shown = msg.content ?? "";
    if (msg !== state.streaming) addCopyButtons(content);
  }
  const calls = msg.tool_calls ?? [];
  while (tools.children.length < calls.length) {
    const d = element("details", "tool-call");
    d.open = true;
    d.append(element("summary"), element("pre"));
    tools.append(d);
  }
  calls.forEach((call, i) => {
    const [summary, pre] = tools.children[i].children;
    summary.textContent = `Tool call: ${call.name || "…"}`;
    pre.textContent = pretty(call.arguments);
  });
  stats.textContent = statsLine(msg);
  li.classList.toggle("error", Boolean(msg.error));
  li.classList.toggle("streaming", msg === state.streaming);
}

function pretty(args) {
  try {
    return JSON.stringify(JSON.parse(args), null, 2);
  } catch {
    return args;
  }
}

function statsLine(msg) {
  const s = msg.stats ?? {};
  const parts = [];
  if (s.ttft != null) parts.push(`TTFT ${Math.round(s.ttft)} ms`);
  if (s.tps != null) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s.tokens != null) parts.push(`${s.tokens} tokens`);
  if (msg.stopped) parts.push("stopped");
  else if (msg.finish && msg.finish !== "stop") parts.push(`finish: ${msg.finish}`);
  if (msg.error) parts.push(`error: ${msg.error}`);
  return parts.join(" · ");
}

function renderMessages() {
  const conv = conversation();
  $("messages").replaceChildren(...(conv?.messages ?? []).map(messageView));
  $("system").value = conv?.system ?? "";
  if (conv?.model && [...$("model").options].some((o) => o.value === conv.model)) $("model").value = conv.model;
  scrollDown(true);
}

function renderConversations() {
  $("conversations").replaceChildren(
    ...state.conversations.map((conv) => {
      const li = element("li", conv.id === state.current ? "current" : "");
      const open = element("button", "title", conv.title);
      open.type = "button";
      open.onclick = () => selectConversation(conv.id);
      const del = element("button", "icon delete", "×");
      Object.assign(del, { type: "button", title: "Delete this conversation" });
      del.onclick = () => deleteConversation(conv.id);
      li.append(open, del);
      return li;
    }),
  );
}

function renderAll() {
  renderConversations();
  renderMessages();
}

function scrollDown(force = false) {
  const box = $("messages");
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 120) box.scrollTop = box.scrollHeight;
}

function renderAttachments() {
  $("attachments").replaceChildren(
    ...state.attachments.map((url, i) => {
      const remove = element("button", "icon", "×");
      Object.assign(remove, { type: "button", title: "Remove this image" });
      remove.onclick = () => {
        state.attachments.splice(i, 1);
        renderAttachments();
      };
      const figure = element("figure", "thumb");
      figure.append(Object.assign(element("img"), { src: url, alt: "image to send" }), remove);
      return figure;
    }),
  );
}

// --- sending and streaming ----------------------------------------------------------------------
function requestBody(conv) {
  const s = state.settings;
  const messages = conv.system ? [{ role: "system", content: conv.system }] : [];
  for (const m of conv.messages.slice(0, -1)) {
    if (m.role === "user" && m.images?.length) {
      const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
      messages.push({ role: "user", content: [...parts, { type: "text", text: m.content }] });
    } else if (m.role === "user" || m.content) {
      messages.push({ role: m.role, content: m.content });
    }
  }
  // return_timings: the server's own decode rate comes with the last chunk (docs/gateway.md); the
  // browser's clock would measure how the chunks were buffered on the way.
  const body = { model: conv.model || undefined, messages, stream: true, stream_options: { include_usage: true } };
  body.return_timings = true;
  for (const name of NUMBERS) if (s[name] !== "" && s[name] != null) body[name] = Number(s[name]);
  if (s.json) body.response_format = { type: "json_object" };
  if (s.tools?.trim()) {
    try {
      body.tools = JSON.parse(s.tools);
    } catch (err) {
      throw new Error(`the tools are not valid JSON: ${err.message}`);
    }
  }
  if (s.tool_choice && body.tools) body.tool_choice = s.tool_choice;
  return body;
}

/** The data of each server-sent event of a response, as they arrive. */
async function* sseEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const lines = buffer.slice(0, end).split("\n");
      buffer = buffer.slice(end + 2);
      const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart());
      if (data.length) yield data.join("\n");
    }
  }
}

function mergeToolCall(calls, delta) {
  const call = (calls[delta.index ?? calls.length] ??= { id: "", name: "", arguments: "" });
  call.id ||= delta.id ?? "";
  call.name ||= delta.function?.name ?? "";
  call.arguments += delta.function?.arguments ?? "";
}

async function send() {
  if (state.controller) return;
  const text = $("input").value.trim();
  if (!text && !state.attachments.length) return;
  const conv = conversation() ?? newConversation();
  conv.model = $("model").value;
  conv.messages.push({ role: "user", content: text, images: state.attachments });
  if (conv.title === "New chat") conv.title = text.slice(0, 48) || "Image";
  const answer = { role: "assistant", content: "", reasoning: "", tool_calls: [], stats: {} };
  conv.messages.push(answer);
  state.attachments = [];
  $("input").value = "";
  renderAttachments();
  renderAll();
  save();
  await stream(conv, answer, $("messages").lastElementChild);
  save();
}

async function stream(conv, answer, view) {
  const controller = new AbortController();
  const started = performance.now();
  let first = null;
  let deltas = 0;
  let frame = 0;
  let [waiting, lag] = [null, 0]; // when the oldest chunk not shown yet arrived; the longest such wait
  const paint = () => {
    frame = 0;
    updateAnswer(view, answer);
    scrollDown();
    if (waiting !== null) lag = Math.max(lag, performance.now() - waiting);
    waiting = null;
  };
  Object.assign(state, { controller, streaming: answer });
  setBusy(true);
  try {
    const init = { method: "POST", headers: { "Content-Type": "application/json" }, signal: controller.signal };
    const response = await api("v1/chat/completions", { ...init, body: JSON.stringify(requestBody(conv)) });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const data of sseEvents(response)) {
      if (data === "[DONE]") break;
      const event = JSON.parse(data);
      if (event.error) throw new Error(event.error.message ?? JSON.stringify(event.error));
      if (event.usage) answer.stats.tokens = event.usage.completion_tokens;
      if (event.timings) answer.timings = event.timings;
      for (const choice of event.choices ?? []) {
        const d = choice.delta ?? {};
        const reasoning = d.reasoning_content ?? d.reasoning;
        if (d.content) answer.content += d.content;
        if (reasoning) answer.reasoning += reasoning;
        for (const call of d.tool_calls ?? []) mergeToolCall(answer.tool_calls, call);
        if (d.content || reasoning || d.tool_calls?.length) {
          first ??= performance.now();
          deltas += 1;
        }
        answer.finish = choice.finish_reason ?? answer.finish;
      }
      waiting ??= performance.now();
      frame ||= requestAnimationFrame(paint); // Markdown re-rendered at most once a frame
    }
  } catch (err) {
    if (err.name === "AbortError") answer.stopped = true;
    else answer.error = err.message;
  } finally {
    cancelAnimationFrame(frame);
    const end = performance.now();
    const tokens = answer.stats.tokens ?? (deltas || null);
    answer.stats = { tokens, ttft: first === null ? null : first - started };
    if (answer.timings?.predicted_ms > 0) answer.stats.tps = answer.timings.predicted_per_second;
    else if (first !== null && tokens > 1 && end > first) answer.stats.tps = ((tokens - 1) * 1000) / (end - first);
    Object.assign(state, { controller: null, streaming: null });
    setBusy(false);
    delete view.querySelector(".content").dataset.shown; // rendered once more, with copy buttons
    paint();
    view.dataset.renderLagMs = Math.round(lag); // what the browser tests check
  }
}

function stop() {
  state.controller?.abort(); // closes the connection: the server aborts the request
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  $("hint").textContent = busy ? "Generating… (Esc stops)" : "";
}

function addCopyButtons(content) {
  for (const pre of content.querySelectorAll("pre")) {
    const code = (pre.querySelector("code") ?? pre).textContent;
    const copy = element("button", "copy", "Copy");
    copy.type = "button";
    copy.onclick = () => navigator.clipboard?.writeText(code);
    pre.append(copy);
  }
}

// --- conversations ------------------------------------------------------------------------------
function selectConversation(id) {
  if (state.controller) stop();
  state.current = id;
  document.body.classList.remove("sidebar-open");
  renderAll();
  save();
}

function deleteConversation(id) {
  if (!confirm("Delete this conversation?")) return;
  state.conversations = state.conversations.filter((c) => c.id !== id);
  if (state.current === id) state.current = state.conversations[0]?.id ?? null;
  renderAll();
  save();
}

function exportAll() {
  const data = { format: "splitserve-chat", version: 1, conversations: state.conversations };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = Object.assign(element("a"), { href: url, download: `splitserve-chats-${new Date().toISOString().slice(0, 10)}.json` });
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

async function importFile(file) {
  try {
    const data = JSON.parse(await file.text());
    const list = (Array.isArray(data) ? data : data.conversations ?? []).filter((c) => c && Array.isArray(c.messages));
    if (!list.length) throw new Error("no conversation in it");
    for (const conv of list.reverse()) {
      conv.id ||= crypto.randomUUID?.() ?? String(Math.random());
      conv.title ||= "Imported chat";
      state.conversations = [conv, ...state.conversations.filter((c) => c.id !== conv.id)];
    }
    state.current = state.conversations[0].id;
    renderAll();
    save();
  } catch (err) {
    note(`${file.name} could not be imported: ${err.message}`, "error");
  }
}

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      state.attachments.push(reader.result);
      renderAttachments();
    };
    reader.readAsDataURL(file);
  }
}

// --- start --------------------------------------------------------------------------------------
function bind() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("input").addEventListener("paste", (e) => attach(e.clipboardData?.files ?? []));
  document.addEventListener("keydown", (e) => e.key === "Escape" && state.controller && stop());
  $("stop").onclick = stop;
  $("new-chat").onclick = () => {
    newConversation();
    document.body.classList.remove("sidebar-open");
    renderAll();
    save();
    $("input").focus();
  };
  $("toggle-sidebar").onclick = () => document.body.classList.toggle("sidebar-open");
  $("export").onclick = exportAll;
  $("import").onchange = (e) => e.target.files[0] && importFile(e.target.files[0]);
  $("attach").onchange = (e) => {
    attach(e.target.files);
    e.target.value = "";
  };
  $("model").onchange = () => {
    state.settings.model = $("model").value;
    if (conversation()) conversation().model = $("model").value;
    save();
  };
  $("system").oninput = () => {
    const conv = conversation() ?? newConversation();
    conv.system = $("system").value;
    renderConversations();
    save();
  };
  for (const name of FIELDS) {
    const input = $(name);
    if (input.type === "checkbox") input.checked = Boolean(state.settings[name]);
    else input.value = state.settings[name] ?? "";
    input.oninput = input.onchange = () => {
      state.settings[name] = input.type === "checkbox" ? input.checked : input.value;
      save();
    };
  }
  keyButton(loadModels);
}

async function loadMarkdown() {
  const [md, purify] = await Promise.all([vendor("marked.js", PLAIN), vendor("purify.js", PLAIN)]);
  if (!md?.marked || !purify?.default) return; // answers stay plain text: never unsanitised HTML
  const DOMPurify = purify.default;
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A") Object.assign(node, { target: "_blank", rel: "noopener noreferrer" });
  });
  state.markdown = (text) => DOMPurify.sanitize(md.marked.parse(text, { async: false }));
  for (const li of $("messages").querySelectorAll(".message.assistant")) {
    delete li.querySelector(".content").dataset.shown;
    updateAnswer(li, li.msg);
  }
}

load();
bind();
renderAll();
loadModels();
loadMarkdown();
