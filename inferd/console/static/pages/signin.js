// Sign-in: an API key or a JWT, checked with /api/v1/whoami, then kept in this tab's
// session storage only.

import { ApiError, credential, get } from '../api.js';
import { h, replace } from '../dom.js';

export async function render(main, { me, signedIn }) {
  if (me) {
    main.append(h('h1', null, 'Signed in'), h('p', null, me.auth ? 'You are signed in.' : 'This server has authentication off: no credential is needed. ', h('a', { href: '#/' }, 'Go to the overview')));
    return null;
  }
  const input = h('input', { id: 'credential', type: 'password', autocomplete: 'off', spellcheck: 'false', required: true, 'aria-describedby': 'credential-help' });
  const message = h('div', { role: 'alert' });
  const form = h('form', { class: 'panel', novalidate: true },
    h('h1', null, 'Sign in to inferd'),
    h('p', { id: 'credential-help', class: 'muted' },
      'Paste an API key (ik_…) or a JWT. It stays in this browser tab only (session storage), is sent as the Authorization header, and is forgotten when you sign out or close the tab.'),
    h('label', { for: 'credential' }, 'API key or token', input),
    h('p', null, h('button', { type: 'submit' }, 'Sign in')),
    message);
  form.addEventListener('submit', async (event) => {
    event.preventDefault();
    const value = input.value.trim();
    replace(message);
    if (!value) {
      message.append(h('div', { class: 'notice bad' }, 'Paste a key or a token first.'));
      return;
    }
    credential.set(value);
    input.value = '';
    try {
      const found = await get('/api/v1/whoami', { quiet401: true });
      await signedIn(found);
    } catch (error) {
      credential.clear();
      const why = error instanceof ApiError && error.status === 401 ? 'The server refused it: ' : 'Sign-in failed: ';
      message.append(h('div', { class: 'notice bad' }, why + error.message));
    }
  });
  main.append(h('div', { class: 'signin' }, form));
  input.focus();
  return null;
}
