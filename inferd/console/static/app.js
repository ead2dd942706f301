// The console's entry: who is signed in, which page the fragment names, and the page's
// lifetime (a page's polling stops when another page opens).

import { ApiError, credential, get, whenUnauthorized } from './api.js';
import { h, replace, toast } from './dom.js';
import * as overview from './pages/overview.js';
import * as model from './pages/model.js';
import * as playground from './pages/playground.js';
import * as jobs from './pages/jobs.js';
import * as logs from './pages/logs.js';
import * as keys from './pages/keys.js';
import * as signin from './pages/signin.js';

const PAGES = {
  '': overview, models: model, playground, jobs, logs, keys, signin,
};
const main = document.getElementById('main');
const nav = document.getElementById('nav');
const who = document.getElementById('who');
let me = null;
let cleanup = null;
let shown = 0;

function parse(hash) {
  const [path, query] = hash.replace(/^#\/?/, '').split('?');
  const parts = path.split('/').filter(Boolean).map(decodeURIComponent);
  return { page: parts[0] || '', params: parts.slice(1), query: new URLSearchParams(query || '') };
}

async function whoami() {
  try {
    if (!credential.get()) {
      const index = await get('/', { headers: { Accept: 'application/json' } });
      if (index.auth) return null; // sign in first: nothing is asked that would be refused
    }
    return await get('/api/v1/whoami', { quiet401: true });
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) return null;
    throw error;
  }
}

function showWho() {
  replace(who);
  if (!me) return;
  if (me.auth) {
    const scope = me.admin ? 'admin' : (me.scopes || []).join(', ');
    who.append(h('span', null, (me.subject || 'signed in') + ' · ' + scope),
      h('button', { type: 'button', onclick: signOut }, 'Sign out'));
  } else {
    who.append(h('span', { class: 'muted-light' }, 'auth off'));
  }
}

function signOut() {
  credential.clear();
  me = null;
  location.hash = '#/signin';
  show();
}

function showNav(page) {
  nav.hidden = !me;
  for (const link of nav.querySelectorAll('a')) {
    link.hidden = link.hasAttribute('data-admin') && !(me && me.admin);
    if (link.dataset.page === (page || 'overview') || (page === 'models' && link.dataset.page === 'overview')) {
      link.setAttribute('aria-current', 'page');
    } else {
      link.removeAttribute('aria-current');
    }
  }
}

async function show() {
  const turn = ++shown;
  if (cleanup) { try { cleanup(); } catch { /* a page that failed to start */ } cleanup = null; }
  const { page, params, query } = parse(location.hash);
  if (!me) me = await whoami();
  if (turn !== shown) return;
  if (!me && page !== 'signin') {
    location.replace('#/signin');
    return;
  }
  const module = PAGES[page] || null;
  showWho();
  showNav(page);
  replace(main);
  if (!module) {
    main.append(h('h1', null, 'Not found'), h('p', null, 'No console page here. ', h('a', { href: '#/' }, 'Back to the overview')));
    return;
  }
  if (module.adminOnly && !me.admin) {
    main.append(h('h1', null, 'Admins only'), h('p', null, 'This page needs a credential with the admin scope.'));
    return;
  }
  try {
    cleanup = (await module.render(main, { me, params, query, signedIn: onSignedIn })) || null;
  } catch (error) {
    main.append(h('div', { class: 'notice bad', role: 'alert' }, 'This page could not load: ' + error.message));
  }
}

async function onSignedIn(found) {
  me = found;
  location.hash = '#/';
}

whenUnauthorized((message) => {
  credential.clear();
  me = null;
  toast('Signed out: ' + (message || 'the credential was refused'));
  location.hash = '#/signin';
});

window.addEventListener('hashchange', show);
show();
