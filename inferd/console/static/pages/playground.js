// Playground: a form made from the version's signature (predict), a chat or completion
// with tokens appearing as they stream (generate), the cosine similarity of two texts
// (embed); every request also shown as code to copy.

import { api, events, get, headers, messageOf } from '../api.js';
import { h, json, ms, num, panel, replace, route } from '../dom.js';
import { curl, openaiPython, requestsPython, snippetBox, tritonPython } from '../snippets.js';

export async function render(main, { me, params }) {
  const name = params[0];
  const models = (await get('/api/v1/models')).models;
  const picker = h('select', { id: 'playground-model', onchange: (e) => { location.hash = route('playground', e.target.value); } },
    h('option', { value: '' }, 'Choose a model'),
    models.map((m) => h('option', { value: m.name, selected: m.name === name }, m.name + ' (' + m.framework + ')')));
  main.append(h('h1', null, 'Playground'), h('p', null, h('label', { for: 'playground-model', class: 'inline' }, 'Model', picker)));
  if (!name) return null;
  const model = await get('/api/v1/models/' + encodeURIComponent(name));
  const version = model.versions.find((v) => v.version === model.serving_version) || model.versions[model.versions.length - 1];
  if (!version) {
    main.append(h('p', null, 'This model has no version.'));
    return null;
  }
  const auth = Boolean(me.auth);
  main.append(h('p', { class: 'muted' }, 'Serving ', model.serving_version || 'no version yet', ' · ', h('a', { href: route('models', name) }, 'model page')));
  const outputs = version.signature.outputs || [];
  if (model.framework === 'gpt2' || model.framework === 'llm') return generation(main, model, version, auth);
  if (outputs.some((o) => o.name === 'embedding')) return embeddings(main, model, auth);
  return predict(main, model, version, auth);
}

// -- predict --------------------------------------------------------------------------------

function exampleRow(version) {
  const meta = version.metadata || {};
  const row = {};
  for (const spec of version.signature.inputs || []) {
    const width = spec.shape && spec.shape.length > 1 ? spec.shape[spec.shape.length - 1] : null;
    if (spec.datatype === 'BYTES' || spec.datatype === 'STRING') row[spec.name] = typeof meta.example === 'string' ? meta.example : 'This product works really well';
    else if (width && width > 0) row[spec.name] = Array.isArray(meta.example) && meta.example.length === width ? meta.example : new Array(width).fill(0.5);
    else row[spec.name] = 0.5;
  }
  return row;
}

function fieldsFor(version, row, onchange) {
  const meta = version.metadata || {};
  const blocks = [];
  for (const spec of version.signature.inputs || []) {
    const value = row[spec.name];
    if (Array.isArray(value) && value.length <= 64) {
      const labels = Array.isArray(meta.features) && meta.features.length === value.length ? meta.features : null;
      blocks.push(h('fieldset', null, h('legend', null, spec.name + ' (' + spec.datatype + ', ' + value.length + ')'),
        h('div', { class: 'form-grid' }, value.map((v, i) => {
          const id = 'in-' + spec.name.replace(/\W/g, '_') + '-' + i;
          const input = h('input', { id, type: 'number', step: 'any', value: String(v), 'data-input': spec.name, 'data-index': String(i) });
          input.addEventListener('input', () => { row[spec.name][i] = Number(input.value); onchange(); });
          const name = labels ? String(labels[i]) : spec.name + '[' + i + ']';
          return h('label', { for: id }, h('span', { class: 'name', title: name }, name), input);
        }))));
    } else if (typeof value === 'string') {
      const id = 'in-' + spec.name.replace(/\W/g, '_');
      const area = h('textarea', { id, rows: 3, 'data-input': spec.name }, value);
      area.addEventListener('input', () => { row[spec.name] = area.value; onchange(); });
      blocks.push(h('label', { for: id, class: 'block' }, spec.name + ' (' + spec.datatype + ')', area));
    } else if (typeof value === 'number') {
      const id = 'in-' + spec.name.replace(/\W/g, '_');
      const input = h('input', { id, type: 'number', step: 'any', value: String(value), 'data-input': spec.name });
      input.addEventListener('input', () => { row[spec.name] = Number(input.value); onchange(); });
      blocks.push(h('label', { for: id }, spec.name, input));
    }
  }
  return blocks;
}

function predict(main, model, version, auth) {
  const row = exampleRow(version);
  const body = h('textarea', { id: 'request-body', rows: 6, spellcheck: 'false' });
  const sync = () => { body.value = json({ inputs: [row] }); };
  const fields = fieldsFor(version, row, sync);
  sync();
  const reply = h('pre', { class: 'output', id: 'reply', 'aria-live': 'polite' }, 'The answer shows here.');
  const timing = h('p', { class: 'muted', id: 'timing' });
  const snippets = h('div');
  const send = h('button', { type: 'submit', id: 'predict' }, 'Predict');
  const form = h('form', { 'aria-label': 'Predict' }, fields,
    h('label', { for: 'request-body', class: 'block' }, 'Request body (edit to send several rows)', body), h('p', null, send));
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    let payload;
    try { payload = JSON.parse(body.value); } catch (error) { reply.textContent = 'The request body is not JSON: ' + error.message; return; }
    const path = '/api/v1/models/' + encodeURIComponent(model.name) + '/predict';
    send.disabled = true;
    const started = performance.now();
    try {
      const { data } = await api('POST', path, { body: payload });
      const roundTrip = performance.now() - started;
      reply.textContent = json({ version: data.version, outputs: data.outputs });
      reply.dataset.outputs = JSON.stringify(data.outputs);
      timing.textContent = 'Answered by ' + data.version + ' in ' + ms(data.latency_ms) + ' at the server, ' + ms(roundTrip) + ' round trip · request ' + data.request_id;
    } catch (error) {
      reply.textContent = 'Error ' + (error.status || '') + ': ' + error.message;
    } finally {
      send.disabled = false;
    }
    const rows = Array.isArray(payload.inputs) ? payload.inputs : [];
    replace(snippets, snippetBox({
      curl: curl(path, payload, auth),
      'Python requests': requestsPython(path, payload, auth),
      tritonclient: tritonPython(model.name, version.signature, rows, auth),
    }));
  });
  main.append(panel('Predict with ' + model.name, form), panel('Answer', reply, timing, snippets));
  return null;
}

// -- generate -------------------------------------------------------------------------------

function generation(main, model, version, auth) {
  const adapters = Object.keys((version.metadata || {}).adapters || {});
  const target = h('select', { id: 'gen-model' }, [model.name, ...adapters].map((n) => h('option', { value: n }, n)));
  const kind = h('select', { id: 'gen-kind' }, h('option', { value: 'chat' }, 'Chat'), h('option', { value: 'completion' }, 'Completion'));
  const system = h('textarea', { id: 'gen-system', rows: 2 }, '');
  const prompt = h('textarea', { id: 'gen-prompt', rows: 4 }, 'Write one sentence about Python lists.');
  const maxTokens = h('input', { id: 'gen-max', type: 'number', min: 1, max: 4096, value: '48' });
  const temperature = h('input', { id: 'gen-temp', type: 'number', min: 0, max: 2, step: '0.1', value: '0' });
  const stream = h('input', { id: 'gen-stream', type: 'checkbox', checked: true });
  const schema = h('textarea', { id: 'gen-schema', rows: 4, placeholder: '{"type": "object", "properties": {...}}' });
  const tools = h('textarea', { id: 'gen-tools', rows: 4, placeholder: '[{"type": "function", "function": {"name": ..., "parameters": {...}}}]' });
  const out = h('div', { class: 'output', id: 'generated', 'aria-live': 'polite' });
  const calls = h('div', { id: 'tool-calls' });
  const timing = h('p', { class: 'muted', id: 'timing' });
  const snippets = h('div');
  const send = h('button', { type: 'submit', id: 'generate' }, 'Generate');
  const form = h('form', { 'aria-label': 'Generate' },
    h('div', { class: 'row' }, h('label', { for: 'gen-model' }, 'Model or adapter', target), h('label', { for: 'gen-kind' }, 'API', kind),
      h('label', { for: 'gen-max' }, 'Max tokens', maxTokens), h('label', { for: 'gen-temp' }, 'Temperature', temperature),
      h('label', { for: 'gen-stream', class: 'inline' }, stream, 'Stream')),
    h('label', { for: 'gen-system', class: 'block' }, 'System message (chat)', system),
    h('label', { for: 'gen-prompt', class: 'block' }, 'Prompt', prompt),
    h('details', null, h('summary', null, 'JSON-schema output and tools'),
      h('label', { for: 'gen-schema', class: 'block' }, 'JSON schema the answer must follow (chat)', schema),
      h('label', { for: 'gen-tools', class: 'block' }, 'Tools (chat, OpenAI format)', tools)),
    h('p', null, send));
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    replace(out);
    replace(calls);
    timing.textContent = '';
    let body;
    try {
      body = requestBody(kind.value, target.value, system.value, prompt.value, maxTokens.value, temperature.value, stream.checked, schema.value, tools.value);
    } catch (error) {
      out.textContent = error.message;
      return;
    }
    const path = kind.value === 'chat' ? '/v1/chat/completions' : '/v1/completions';
    replace(snippets, snippetBox({ curl: curl(path, body, auth, body.stream), 'Python openai': openaiPython(kind.value, body, auth) }));
    send.disabled = true;
    try {
      await run(path, body, kind.value, out, calls, timing);
    } catch (error) {
      out.textContent = 'Error: ' + error.message;
    } finally {
      send.disabled = false;
    }
  });
  main.append(panel('Generate with ' + model.name, form), panel('Answer', out, calls, timing, snippets));
  return null;
}

function requestBody(kind, model, system, prompt, maxTokens, temperature, stream, schema, tools) {
  const body = { model, max_tokens: Number(maxTokens), temperature: Number(temperature) };
  if (kind === 'chat') {
    body.messages = [...(system.trim() ? [{ role: 'system', content: system }] : []), { role: 'user', content: prompt }];
    if (schema.trim()) body.response_format = { type: 'json_schema', json_schema: { name: 'answer', schema: parse(schema, 'The JSON schema') } };
    if (tools.trim()) body.tools = parse(tools, 'The tools');
  } else {
    body.prompt = prompt;
  }
  if (stream) body.stream = true;
  return body;
}

function parse(text, what) {
  try { return JSON.parse(text); } catch (error) { throw new Error(what + ' is not JSON: ' + error.message); }
}

async function run(path, body, kind, out, calls, timing) {
  const started = performance.now();
  const res = await fetch(path, { method: 'POST', headers: headers({ 'Content-Type': 'application/json' }), body: JSON.stringify(body), cache: 'no-store', credentials: 'omit' });
  if (!res.ok) {
    const text = await res.text();
    let data = text;
    try { data = JSON.parse(text); } catch { /* plain text */ }
    throw new Error(res.status + ' ' + messageOf(data));
  }
  let first = null;
  let pieces = 0;
  let finish = '';
  const toolCalls = [];
  if (!body.stream) {
    const data = await res.json();
    const choice = data.choices[0];
    out.textContent = kind === 'chat' ? (choice.message.content || '') : choice.text;
    for (const call of choice.message?.tool_calls || []) toolCalls.push(call);
    finish = choice.finish_reason;
    pieces = data.usage?.completion_tokens || 0;
  } else {
    for await (const data of events(res)) {
      if (data === '[DONE]') break;
      const chunk = JSON.parse(data);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const text = kind === 'chat' ? (choice.delta?.content || '') : (choice.text || '');
      if (text) {
        if (first === null) first = performance.now() - started;
        pieces += 1;
        out.append(document.createTextNode(text));
      }
      for (const call of choice.delta?.tool_calls || []) mergeCall(toolCalls, call);
      if (choice.finish_reason) finish = choice.finish_reason;
    }
  }
  const total = performance.now() - started;
  if (toolCalls.length) calls.append(h('h3', null, 'Tool calls'), h('pre', { class: 'output' }, json(toolCalls)));
  timing.textContent = (first !== null ? 'First token after ' + ms(first) + ' · ' : '') + pieces + ' chunks in ' + ms(total)
    + (first !== null && total > first ? ' · ' + num((pieces - 1) / ((total - first) / 1000), 1) + ' chunks/s' : '') + ' · finish: ' + (finish || '–');
  out.dataset.done = 'true';
}

function mergeCall(calls, delta) {
  const index = delta.index ?? calls.length;
  const call = calls[index] || (calls[index] = { id: delta.id, type: 'function', function: { name: '', arguments: '' } });
  if (delta.id) call.id = delta.id;
  if (delta.function?.name) call.function.name += delta.function.name;
  if (delta.function?.arguments) call.function.arguments += delta.function.arguments;
}

// -- embeddings -----------------------------------------------------------------------------

function embeddings(main, model, auth) {
  const a = h('textarea', { id: 'emb-a', rows: 3 }, 'The delivery was fast and the product works.');
  const b = h('textarea', { id: 'emb-b', rows: 3 }, 'Shipping was quick and it does what it should.');
  const result = h('p', { class: 'output', id: 'similarity', 'aria-live': 'polite' }, 'The cosine similarity shows here.');
  const snippets = h('div');
  const form = h('form', { 'aria-label': 'Embeddings' },
    h('label', { for: 'emb-a', class: 'block' }, 'First text', a), h('label', { for: 'emb-b', class: 'block' }, 'Second text', b),
    h('p', null, h('button', { type: 'submit', id: 'embed' }, 'Compare')));
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const body = { model: model.name, input: [a.value, b.value] };
    replace(snippets, snippetBox({ curl: curl('/v1/embeddings', body, auth), 'Python openai': openaiPython('embeddings', body, auth) }));
    const started = performance.now();
    try {
      const { data } = await api('POST', '/v1/embeddings', { body });
      const [x, y] = data.data.map((d) => d.embedding);
      const similarity = cosine(x, y);
      result.textContent = 'Cosine similarity ' + similarity.toFixed(4) + ' · ' + x.length + ' dimensions · ' + ms(performance.now() - started) + ' round trip';
      result.dataset.similarity = String(similarity);
    } catch (error) {
      result.textContent = 'Error: ' + error.message;
    }
  });
  main.append(panel('Embed with ' + model.name, form), panel('Answer', result, snippets));
  return null;
}

function cosine(x, y) {
  let dot = 0;
  let nx = 0;
  let ny = 0;
  for (let i = 0; i < x.length; i += 1) { dot += x[i] * y[i]; nx += x[i] * x[i]; ny += y[i] * y[i]; }
  return dot / Math.sqrt(nx * ny);
}

