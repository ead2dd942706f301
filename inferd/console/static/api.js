// The API, with the credential the person pasted: kept in this tab's session storage
// (gone when the tab closes), sent as Authorization, never put in a URL or a cookie.

const KEY = 'inferd.credential';

export const credential = {
  get: () => sessionStorage.getItem(KEY),
  set: (value) => sessionStorage.setItem(KEY, value),
  clear: () => sessionStorage.removeItem(KEY),
};

export class ApiError extends Error {
  constructor(status, body, message) {
    super(message);
    this.status = status;
    this.body = body;
  }
}

// inferd's {"error": {"message"}}, OpenAI's {"error": {"message"}}, V2's {"error": "..."}.
export function messageOf(body) {
  if (!body) return '';
  if (typeof body === 'string') return body;
  const error = body.error ?? body.detail;
  if (typeof error === 'string') return error;
  if (error && typeof error.message === 'string') return error.message;
  return JSON.stringify(body).slice(0, 300);
}

let onUnauthorized = () => {};
export function whenUnauthorized(handler) { onUnauthorized = handler; }

export function headers(extra = {}) {
  const out = { ...extra };
  const value = credential.get();
  if (value) out.Authorization = 'Bearer ' + value;
  return out;
}

export async function request(method, path, { body, headers: extra, signal } = {}) {
  const init = { method, headers: headers(extra), cache: 'no-store', credentials: 'omit', signal };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = typeof body === 'string' ? body : JSON.stringify(body);
  }
  return fetch(path, init);
}

export async function api(method, path, options = {}) {
  const res = await request(method, path, options);
  const text = await res.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = text; }
  if (!res.ok) {
    if (res.status === 401 && !options.quiet401) onUnauthorized(messageOf(data));
    throw new ApiError(res.status, data, messageOf(data) || res.statusText);
  }
  return { data, res };
}

export const get = async (path, options) => (await api('GET', path, options)).data;

// Server-sent events of a streamed answer: yields each event's data.
export async function* events(res) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, '\n');
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).trimStart()).join('\n');
      if (data) yield data;
    }
  }
}

// Runs `fn` now and `ms` after each run settles, skipping runs while the tab is hidden;
// `first` settles with the first run (a page shows its data before it returns).
export function every(ms, fn) {
  let timer = 0;
  let stopped = false;
  const tick = async () => {
    if (document.visibilityState !== 'hidden') {
      try { await fn(); } catch { /* fn shows its own errors */ }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  return { first: tick(), stop: () => { stopped = true; clearTimeout(timer); } };
}
