// The request the playground just sent, as code to copy: curl, Python (requests or the
// openai client) and tritonclient. Run as shown, each gives the same answer. A
// credential is never written into them: they read $INFERD_API_KEY.

import { copy, h } from './dom.js';

export function shellQuote(text) {
  return "'" + String(text).replace(/'/g, "'\\''") + "'";
}

// A JSON value as a Python literal (JSON's string escapes are Python's too).
export function python(value, indent = 0) {
  const pad = '    '.repeat(indent + 1);
  const end = '    '.repeat(indent);
  if (value === null || value === undefined) return 'None';
  if (value === true) return 'True';
  if (value === false) return 'False';
  if (typeof value === 'number') return Number.isFinite(value) ? String(value) : 'float("' + String(value).toLowerCase() + '")';
  if (typeof value === 'string') return JSON.stringify(value);
  if (Array.isArray(value)) {
    const flat = '[' + value.map((v) => python(v, indent)).join(', ') + ']';
    if (flat.length < 80) return flat;
    return '[\n' + value.map((v) => pad + python(v, indent + 1)).join(',\n') + ',\n' + end + ']';
  }
  const entries = Object.entries(value);
  const flat = '{' + entries.map(([k, v]) => JSON.stringify(k) + ': ' + python(v, indent)).join(', ') + '}';
  if (flat.length < 80) return flat;
  return '{\n' + entries.map(([k, v]) => pad + JSON.stringify(k) + ': ' + python(v, indent + 1)).join(',\n') + ',\n' + end + '}';
}

export function curl(path, body, auth, stream = false) {
  const lines = ['curl -s' + (stream ? 'N' : '') + ' ' + location.origin + path, "-H 'Content-Type: application/json'"];
  if (auth) lines.push('-H "Authorization: Bearer $INFERD_API_KEY"');
  lines.push('-d ' + shellQuote(JSON.stringify(body)));
  return lines.join(' \\\n  ');
}

export function requestsPython(path, body, auth) {
  const lines = ['import requests'];
  if (auth) lines.unshift('import os');
  lines.push('', 'response = requests.post(', '    "' + location.origin + path + '",', '    json=' + python(body, 1) + ',');
  if (auth) lines.push('    headers={"Authorization": "Bearer " + os.environ["INFERD_API_KEY"]},');
  lines.push(')', 'response.raise_for_status()', 'print(response.json())');
  return lines.join('\n');
}

export function openaiPython(kind, body, auth) {
  const lines = ['import os', '', 'from openai import OpenAI', '',
    'client = OpenAI(base_url="' + location.origin + '/v1", api_key=os.environ.get("INFERD_API_KEY", "none"))'];
  const args = Object.entries(body).filter(([k]) => k !== 'stream').map(([k, v]) => '    ' + k + '=' + python(v, 1) + ',');
  if (kind === 'embeddings') {
    lines.push('answer = client.embeddings.create(', ...args, ')', 'a, b = (d.embedding for d in answer.data)',
      'dot = sum(x * y for x, y in zip(a, b))', 'norm = (sum(x * x for x in a) * sum(y * y for y in b)) ** 0.5',
      'print(round(dot / norm, 4))');
    return lines.join('\n');
  }
  const method = kind === 'chat' ? 'client.chat.completions.create(' : 'client.completions.create(';
  if (body.stream) {
    lines.push('stream = ' + method, ...args, '    stream=True,', ')', 'for chunk in stream:');
    lines.push(kind === 'chat' ? '    print(chunk.choices[0].delta.content or "", end="", flush=True)' : '    print(chunk.choices[0].text, end="", flush=True)', 'print()');
  } else {
    lines.push('answer = ' + method, ...args, ')');
    lines.push(kind === 'chat' ? 'print(answer.choices[0].message)' : 'print(answer.choices[0].text)');
  }
  return lines.join('\n');
}

const NUMPY = { FP32: 'np.float32', FP64: 'np.float64', FP16: 'np.float16', INT64: 'np.int64', INT32: 'np.int32', INT16: 'np.int16', INT8: 'np.int8', UINT8: 'np.uint8', BOOL: 'np.bool_', BYTES: 'object' };

// tritonclient over the Open Inference Protocol (V2) with the same rows.
export function tritonPython(model, signature, rows, auth) {
  const host = location.host;
  const lines = ['import numpy as np', 'import tritonclient.http as httpclient', '',
    'client = httpclient.InferenceServerClient("' + host + '"' + (location.protocol === 'https:' ? ', ssl=True' : '') + ')'];
  if (auth) lines.unshift('import os');
  const names = [];
  for (const spec of signature.inputs || []) {
    const column = rows.map((r) => r[spec.name]);
    const variable = 'input_' + spec.name.replace(/\W/g, '_');
    const dtype = NUMPY[spec.datatype] || 'np.float32';
    const data = spec.datatype === 'BYTES' ? python(column) : python(column);
    lines.push(variable + ' = np.array(' + data + ', dtype=' + dtype + ')');
    lines.push(variable + '_tensor = httpclient.InferInput("' + spec.name + '", list(' + variable + '.shape), "' + spec.datatype + '")');
    lines.push(variable + '_tensor.set_data_from_numpy(' + variable + ')');
    names.push(variable + '_tensor');
  }
  const headers = auth ? ', headers={"Authorization": "Bearer " + os.environ["INFERD_API_KEY"]}' : '';
  lines.push('result = client.infer("' + model + '", [' + names.join(', ') + ']' + headers + ')');
  for (const spec of signature.outputs || []) lines.push('print("' + spec.name + '", result.as_numpy("' + spec.name + '").tolist())');
  return lines.join('\n');
}

// Tabs of snippets with a copy button each.
export function snippetBox(snippets) {
  const names = Object.keys(snippets);
  const pre = h('pre', { tabindex: '0', 'data-snippet': names[0], 'aria-label': 'Code for this request' }, snippets[names[0]]);
  const tabs = names.map((name, i) => h('button', {
    type: 'button', role: 'tab', 'aria-selected': i === 0 ? 'true' : 'false', 'data-tab': name,
    onclick: (event) => {
      for (const b of tabs) b.setAttribute('aria-selected', b === event.currentTarget ? 'true' : 'false');
      pre.textContent = snippets[name];
      pre.dataset.snippet = name;
    },
  }, name));
  return h('div', { class: 'snippets' },
    h('div', { class: 'row' }, h('div', { class: 'tabs', role: 'tablist', 'aria-label': 'Snippets' }, tabs),
      h('button', { type: 'button', class: 'secondary', onclick: () => copy(pre.textContent, pre) }, 'Copy')),
    pre);
}
