// API keys (admin): list, create (the key is shown this once), revoke.

import { api, get } from '../api.js';
import { confirm, copy, h, panel, replace, table, toast, when } from '../dom.js';

export const adminOnly = true;

export async function render(main) {
  const list = h('div');
  const created = h('div', { 'aria-live': 'polite' });
  const name = h('input', { id: 'key-name', required: true, maxlength: 100 });
  const infer = h('input', { id: 'key-infer', type: 'checkbox', checked: true });
  const admin = h('input', { id: 'key-admin', type: 'checkbox' });
  const models = h('input', { id: 'key-models', placeholder: 'all models', 'aria-describedby': 'key-models-help' });
  const form = h('form', { 'aria-label': 'Create a key' },
    h('div', { class: 'row' },
      h('label', { for: 'key-name' }, 'Name', name),
      h('fieldset', null, h('legend', null, 'Scopes'), h('label', { for: 'key-infer', class: 'inline' }, infer, 'infer'), h('label', { for: 'key-admin', class: 'inline' }, admin, 'admin')),
      h('label', { for: 'key-models' }, 'Models (comma-separated)', models),
      h('button', { type: 'submit' }, 'Create key')),
    h('p', { id: 'key-models-help', class: 'muted' }, 'Leave models empty for every model. A key limited to some models sees only those.'));
  main.append(h('h1', null, 'API keys'), panel('Create a key', form, created), panel('Keys', list));
  const refresh = async () => {
    const data = await get('/api/v1/keys');
    draw(list, data.keys, refresh);
  };
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const scopes = [infer.checked ? 'infer' : null, admin.checked ? 'admin' : null].filter(Boolean);
    const limited = models.value.split(',').map((m) => m.trim()).filter(Boolean);
    try {
      const { data } = await api('POST', '/api/v1/keys', { body: { name: name.value, scopes, models: limited.length ? limited : null } });
      const secret = h('div', { class: 'secret', id: 'new-key' }, data.key);
      replace(created, h('div', { class: 'notice ok' },
        h('p', null, 'Key ', h('code', null, data.key_id), ' created. Copy it now: it is shown this once, and only its hash is kept.'),
        secret, h('p', null, h('button', { type: 'button', class: 'secondary', onclick: () => copy(data.key, secret) }, 'Copy'))));
      name.value = '';
      models.value = '';
      await refresh();
    } catch (error) {
      replace(created, h('div', { class: 'notice bad', role: 'alert' }, 'Not created: ' + error.message));
    }
  });
  await refresh();
  return () => replace(created); // the secret never outlives the page
}

function draw(node, keys, refresh) {
  replace(node, table([
    { title: 'Id', cell: (k) => h('code', null, k.key_id) },
    { title: 'Name', cell: (k) => k.name },
    { title: 'Scopes', cell: (k) => (k.scopes || []).map((s) => h('span', { class: 'chip' }, s)) },
    { title: 'Models', cell: (k) => (k.models ? k.models.join(', ') : 'all') },
    { title: 'Created', cell: (k) => when(k.created_at) },
    { title: 'State', cell: (k) => (k.revoked_at ? h('span', { class: 'state state-failed' }, 'revoked ' + when(k.revoked_at)) : h('span', { class: 'state state-ready' }, 'active')) },
    { title: '', cell: (k) => (k.revoked_at ? '' : h('button', { type: 'button', class: 'danger', 'data-revoke': k.key_id, onclick: async () => {
      if (!(await confirm('Revoke ' + k.key_id + '?', 'Every request with this key is refused within seconds, on every gateway.', 'Revoke'))) return;
      try {
        await api('DELETE', '/api/v1/keys/' + encodeURIComponent(k.key_id));
        toast('Revoked ' + k.key_id);
      } catch (error) {
        toast('Not revoked: ' + error.message);
      }
      refresh();
    } }, 'Revoke')) },
  ], keys, { caption: 'API keys', empty: 'No key yet.' }));
}
