// What the chat page and the dashboard share: calls to this server with the user's API key (asked
// for when the server answers 401), the third-party libraries of static/vendor/ (installed by
// `make setup`; each page works without them and says so), and notes shown at the top of a page.

const KEY = "splitserve.apiKey";

export const $ = (id) => document.getElementById(id);

export function apiKey() {
  return sessionStorage.getItem(KEY) ?? localStorage.getItem(KEY) ?? "";
}

function saveKey(key, remember) {
  localStorage.removeItem(KEY);
  sessionStorage.removeItem(KEY);
  if (key) (remember ? localStorage : sessionStorage).setItem(KEY, key);
}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

/** fetch() of a path of this server (relative: the pages may sit behind a proxy's prefix) with the
 * API key as a bearer token; on a 401, the key is asked for and the call made again. */
export async function api(path, options = {}) {
  for (;;) {
    const key = apiKey();
    const headers = { ...options.headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) };
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    const reason = await errorText(response);
    if (!(await askForKey(reason))) throw new ApiError(401, `${reason} (no API key given)`);
  }
}

/** The message of an error answer: OpenAI's {"error": {"message"}}, else its text. */
export async function errorText(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    return body.error?.message ?? body.detail ?? text;
  } catch {
    return text || `HTTP ${response.status}`;
  }
}

let asking = null; // one prompt for all the calls that failed at once

/** Ask for the API key in a modal dialog; resolves to whether one was given. */
export function askForKey(reason = "") {
  asking ??= new Promise((resolve) => {
    const dialog = document.createElement("dialog");
    dialog.className = "key-dialog"; // "Use key" first: Enter in the field submits with it
    dialog.innerHTML = `<form method="dialog">
      <h2>API key</h2><p class="reason"></p>
      <label>Key <input name="key" type="password" autocomplete="off" autofocus></label>
      <label class="check"><input name="remember" type="checkbox" checked> Remember on this device</label>
      <menu><button value="ok" class="primary">Use key</button>
      <button value="forget">Forget key</button><button value="cancel">Cancel</button></menu></form>`;
    dialog.querySelector(".reason").textContent = reason || "The server's API calls need a key.";
    const form = dialog.querySelector("form");
    dialog.addEventListener("close", () => {
      const key = form.elements.key.value.trim();
      const given = dialog.returnValue === "ok" && key !== "";
      if (given || dialog.returnValue === "forget") saveKey(given ? key : "", form.elements.remember.checked);
      dialog.remove();
      asking = null;
      resolve(given);
    });
    document.body.append(dialog);
    dialog.showModal();
  });
  return asking;
}

/** A module of static/vendor/, or null (with a note saying what the page does without it). */
export async function vendor(file, without) {
  try {
    return await import(new URL(`./vendor/${file}`, import.meta.url));
  } catch (err) {
    note(`${without}: ui/vendor/${file} could not be loaded (\`make setup\` installs it with npm).`);
    console.warn(err);
    return null;
  }
}

/** A line in the page's #notes box (each text once). */
export function note(text, kind = "warn") {
  const box = $("notes");
  if (!box || [...box.children].some((p) => p.textContent === text)) return;
  const p = document.createElement("p");
  p.className = `note ${kind}`;
  p.textContent = text;
  box.append(p);
}

/** The header's "API key" button opens the prompt; `after` runs when a key was given. */
export function keyButton(after) {
  $("key-button")?.addEventListener("click", async () => {
    if (await askForKey("Set the key sent with every call (Authorization: Bearer).")) after?.();
  });
}
