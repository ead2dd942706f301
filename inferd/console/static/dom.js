// Building pages: values reach the page only as text nodes or attributes set one by
// one, never as HTML, so whatever a user put in a model's name, labels or metadata shows
// as the text it is.

export function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key.startsWith('on') && typeof value === 'function') el.addEventListener(key.slice(2), value);
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else if (key === 'value' || key === 'checked' || key === 'disabled' || key === 'selected') el[key] = value;
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

export function replace(el, ...children) {
  return append(clear(el), children);
}

export function route(...parts) {
  return '#/' + parts.map((p) => encodeURIComponent(p)).join('/');
}

// -- numbers -------------------------------------------------------------------------------

export function num(value, digits = 1) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString('en-US');
  return Number(value).toFixed(digits).replace(/\.0+$/, '');
}

export function ms(value) {
  if (value === null || value === undefined) return '–';
  if (value >= 1000) return (value / 1000).toFixed(2) + ' s';
  return (value >= 10 ? value.toFixed(1) : value.toFixed(2)) + ' ms';
}

export function pct(value, digits = 2) {
  if (value === null || value === undefined) return '–';
  return (value * 100).toFixed(digits).replace(/\.?0+$/, '') + ' %';
}

export function bytes(value) {
  if (value === null || value === undefined) return '–';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  let v = value;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
  return (i ? v.toFixed(1) : String(v)) + ' ' + units[i];
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined) return '–';
  if (seconds < 60) return seconds.toFixed(seconds < 10 ? 1 : 0) + ' s';
  if (seconds < 3600) return Math.floor(seconds / 60) + ' min ' + Math.round(seconds % 60) + ' s';
  return Math.floor(seconds / 3600) + ' h ' + Math.round((seconds % 3600) / 60) + ' min';
}

export function when(iso) {
  if (!iso) return '–';
  const t = new Date(iso);
  if (Number.isNaN(t.getTime())) return String(iso);
  return t.toLocaleString('en-GB', { hour12: false });
}

export function ago(iso) {
  if (!iso) return '–';
  const s = (Date.now() - new Date(iso).getTime()) / 1000;
  return s < 0 ? 'just now' : duration(s) + ' ago';
}

export function json(value) {
  return JSON.stringify(value, null, 2);
}

// -- pieces ----------------------------------------------------------------------------------

export function stateLabel(state) {
  return h('span', { class: 'state state-' + String(state).replace(/[^a-z_-]/gi, '') }, state);
}

export function table(columns, rows, { caption, empty = 'Nothing yet.' } = {}) {
  const head = h('tr', null, columns.map((c) => h('th', { scope: 'col', class: c.num ? 'num' : null }, c.title)));
  const body = rows.map((row) => h('tr', null, columns.map((c) => h('td', { class: c.num ? 'num' : null }, c.cell(row)))));
  const t = h('table', null, caption ? h('caption', { class: 'visually-hidden' }, caption) : null,
    h('thead', null, head), h('tbody', null, body));
  if (!rows.length) {
    return h('div', null, t, h('p', { class: 'muted' }, empty));
  }
  return h('div', { class: 'table-wrap' }, t);
}

export function kv(pairs) {
  return h('dl', { class: 'kv' }, pairs.filter(Boolean).map(([k, v]) => [h('dt', null, k), h('dd', null, v)]));
}

export function panel(title, ...children) {
  return h('section', { class: 'panel', 'aria-label': typeof title === 'string' ? title : null },
    title ? h('h2', null, title) : null, children);
}

let toastTimer = 0;
export function toast(message, kind = '') {
  const box = document.getElementById('toast');
  const line = h('div', { class: kind }, message);
  box.append(line);
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => clear(box), 6000);
}

// A modal confirmation: resolves true when the person confirms.
export function confirm(title, message, action = 'Confirm', danger = true) {
  return new Promise((resolve) => {
    const yes = h('button', { type: 'button', class: danger ? 'danger' : null, 'data-confirm': '' }, action);
    const no = h('button', { type: 'button', class: 'secondary' }, 'Cancel');
    const dialog = h('dialog', { 'aria-labelledby': 'dialog-title' },
      h('h2', { id: 'dialog-title' }, title), h('p', null, message), h('div', { class: 'row' }, yes, no));
    const done = (answer) => { dialog.close(); dialog.remove(); resolve(answer); };
    yes.addEventListener('click', () => done(true));
    no.addEventListener('click', () => done(false));
    dialog.addEventListener('cancel', () => done(false));
    document.body.append(dialog);
    dialog.showModal();
    no.focus();
  });
}

// Copy text to the clipboard; falls back to selecting it.
export async function copy(text, node) {
  try {
    await navigator.clipboard.writeText(text);
    toast('Copied.');
  } catch {
    if (node) window.getSelection().selectAllChildren(node);
    toast('Select and copy with Ctrl+C.');
  }
}
