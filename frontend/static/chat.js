// The chat page's behaviour: conversations, sending, streaming a reply, stop and regenerate, settings, the API key
// and images for vision models. Rendering of one message lives in render.js; storage in store.js; HTTP in api.js.

import { HttpError, servedModel, storeApiKey, streamChat } from "./api.js";
import { renderConversations, renderMessage } from "./render.js";
import { loadConversations, loadSettings, newConversation, saveConversations, saveSettings } from "./store.js";

const $ = (id) => document.getElementById(id);
const state = {
  model: null, // { name, vision } once /v1/models answered
  conversations: loadConversations(),
  settings: loadSettings(),
  attachments: [], // data: URLs of the images waiting for the next message
  controller: null, // the AbortController of the reply being streamed
};

function current() {
  return state.conversations.list.find((c) => c.id === state.conversations.current) ?? null;
}

function persist() {
  saveConversations(state.conversations);
  renderConversations($("conversations"), state.conversations, openConversation, deleteConversation);
}

function renderAll() {
  const conversation = current();
  const messages = $("messages");
  messages.replaceChildren(...(conversation?.messages ?? []).map((message, index) =>
    renderMessage(message, index === conversation.messages.length - 1 && !state.controller ? regenerate : null)));
  messages.scrollTop = messages.scrollHeight;
  renderConversations($("conversations"), state.conversations, openConversation, deleteConversation);
}

function openConversation(id) {
  if (state.controller) return;
  state.conversations.current = id;
  document.body.classList.remove("show-sidebar");
  persist();
  renderAll();
}

function deleteConversation(id) {
  if (state.controller && id === state.conversations.current) return;
  state.conversations.list = state.conversations.list.filter((c) => c.id !== id);
  if (state.conversations.current === id) state.conversations.current = null;
  persist();
  renderAll();
}

function notice(text) {
  $("notice").textContent = text ?? "";
  $("notice").hidden = !text;
}

// --- the API key: asked for on a 401, kept in localStorage -------------------------------------------------------

function askForKey(refused) {
  const dialog = $("key-dialog");
  $("key-error").hidden = !refused;
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      storeApiKey($("key-input").value.trim());
      resolve();
    }, { once: true });
    dialog.showModal();
  });
}

// Runs `call`; on a 401 asks for the key and runs it again, until the server takes the key.
async function withKey(call) {
  let refused = false;
  for (;;) {
    try {
      return await call();
    } catch (error) {
      if (!(error instanceof HttpError) || error.status !== 401) throw error;
      await askForKey(refused);
      refused = true;
    }
  }
}

async function connect() {
  try {
    state.model = await withKey(servedModel);
    $("model-name").textContent = state.model.name + (state.model.vision ? " · vision" : "");
    $("drop-zone").hidden = !state.model.vision;
    notice(null);
  } catch (error) {
    $("model-name").textContent = "not connected";
    notice(`Cannot reach the server: ${error.message}`);
  }
}

// --- sending and streaming ---------------------------------------------------------------------------------------

function requestMessages(conversation) {
  const system = state.settings.system.trim();
  const history = conversation.messages.slice(0, -1).map((message) => {
    if (message.role === "assistant") {
      return { role: "assistant", content: message.content, ...(message.reasoning && { reasoning_content: message.reasoning }) };
    }
    if (!message.images?.length) return { role: "user", content: message.content };
    return {
      role: "user",
      content: [{ type: "text", text: message.content },
        ...message.images.map((url) => ({ type: "image_url", image_url: { url } }))],
    };
  });
  return system ? [{ role: "system", content: system }, ...history] : history;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
  document.body.classList.toggle("busy", busy);
}

// Streams a reply into the conversation's last message (an empty assistant turn) and keeps what came if stopped.
async function generate(conversation) {
  if (!state.model) await connect(); // the server was down when the page loaded
  const reply = conversation.messages.at(-1);
  Object.assign(reply, { content: "", reasoning: "", usage: null, stopped: false, error: null, finish: null });
  state.controller = new AbortController();
  setBusy(true);
  renderAll();
  const view = $("messages").lastElementChild;
  const started = performance.now();
  let firstToken = null;
  const body = {
    model: state.model?.name, messages: requestMessages(conversation), stream: true,
    stream_options: { include_usage: true }, temperature: Number(state.settings.temperature),
    max_tokens: Number(state.settings.max_tokens),
  };
  try {
    await withKey(async () => {
      for await (const chunk of streamChat(body, state.controller.signal)) {
        const choice = chunk.choices?.[0];
        const delta = choice?.delta ?? {};
        if ((delta.content || delta.reasoning_content) && firstToken === null) firstToken = performance.now();
        reply.reasoning += delta.reasoning_content ?? "";
        reply.content += delta.content ?? "";
        if (choice?.finish_reason) reply.finish = choice.finish_reason;
        if (chunk.usage) reply.usage = replyUsage(chunk.usage, started, firstToken);
        renderMessage(reply, null, view);
        $("messages").scrollTop = $("messages").scrollHeight;
      }
    });
  } catch (error) {
    if (error.name === "AbortError") reply.stopped = true;
    else reply.error = error.message;
  } finally {
    state.controller = null;
    setBusy(false);
    conversation.updated = Date.now();
    persist();
    renderAll();
  }
}

// Tokens and cached tokens as the server counted them; time to first token and decode speed as this page saw them.
function replyUsage(usage, started, firstToken) {
  const now = performance.now();
  const decodeSeconds = firstToken === null ? 0 : (now - firstToken) / 1000;
  return {
    prompt: usage.prompt_tokens,
    completion: usage.completion_tokens,
    cached: usage.prompt_tokens_details?.cached_tokens ?? 0,
    reasoning: usage.completion_tokens_details?.reasoning_tokens ?? 0,
    ttft: firstToken === null ? null : (firstToken - started) / 1000,
    tps: decodeSeconds > 0 && usage.completion_tokens > 1 ? (usage.completion_tokens - 1) / decodeSeconds : null,
  };
}

async function send(event) {
  event.preventDefault();
  const text = $("prompt").value.trim();
  if (state.controller || (!text && !state.attachments.length)) return;
  let conversation = current();
  if (!conversation) {
    conversation = newConversation();
    state.conversations.list.unshift(conversation);
    state.conversations.current = conversation.id;
  }
  if (!conversation.messages.length) conversation.title = (text || "Image").slice(0, 60);
  conversation.messages.push({ role: "user", content: text, images: state.attachments },
    { role: "assistant", content: "" });
  state.attachments = [];
  $("attachments").replaceChildren();
  $("prompt").value = "";
  await generate(conversation);
}

function regenerate() {
  const conversation = current();
  if (!state.controller && conversation?.messages.at(-1)?.role === "assistant") generate(conversation);
}

// --- images, for vision models: drag and drop onto the page or the file picker -----------------------------------

function attach(files) {
  for (const file of files) {
    if (!file.type.startsWith("image/")) continue;
    const reader = new FileReader();
    reader.onload = () => {
      state.attachments.push(reader.result);
      const image = document.createElement("img");
      image.src = reader.result;
      image.alt = file.name;
      $("attachments").append(image);
    };
    reader.readAsDataURL(file);
  }
}

function setUpImages() {
  const chat = $("chat");
  chat.addEventListener("dragover", (event) => {
    if (!state.model?.vision) return;
    event.preventDefault();
    chat.classList.add("dragging");
  });
  chat.addEventListener("dragleave", () => chat.classList.remove("dragging"));
  chat.addEventListener("drop", (event) => {
    chat.classList.remove("dragging");
    if (!state.model?.vision) return;
    event.preventDefault();
    attach(event.dataTransfer.files);
  });
  $("file-input").addEventListener("change", (event) => attach(event.target.files));
}

// --- settings ----------------------------------------------------------------------------------------------------

function setUpSettings() {
  const fields = { temperature: $("temperature"), max_tokens: $("max-tokens"), system: $("system") };
  for (const [name, input] of Object.entries(fields)) {
    input.value = state.settings[name];
    input.addEventListener("input", () => {
      state.settings[name] = input.value;
      $("temperature-value").textContent = Number(state.settings.temperature).toFixed(2);
      saveSettings(state.settings);
    });
  }
  $("temperature-value").textContent = Number(state.settings.temperature).toFixed(2);
  $("settings-button").addEventListener("click", () => { $("settings").hidden = !$("settings").hidden; });
  $("close-settings").addEventListener("click", () => { $("settings").hidden = true; });
}

function setUp() {
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) send(event);
  });
  $("stop").addEventListener("click", () => state.controller?.abort());
  $("new-chat").addEventListener("click", () => {
    if (state.controller) return;
    state.conversations.current = null;
    document.body.classList.remove("show-sidebar");
    renderAll();
    $("prompt").focus();
  });
  $("menu").addEventListener("click", () => document.body.classList.toggle("show-sidebar"));
  setUpSettings();
  setUpImages();
  renderAll();
  connect();
}

setUp();
