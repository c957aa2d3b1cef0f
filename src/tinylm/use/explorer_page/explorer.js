(function () {
'use strict';
/* The tinylm explorer. Data: tinylm.use.explorer.explorer_data (embedded, or POSTed for in
   live mode). Tensors are float32, base64; everything else is plain JSON. */
var CFG = JSON.parse(document.getElementById('config').textContent);
var D = null, T = {};
var st = {view: 'steps', layer: 0, head: 0, step: 'x', query: 0, mapmode: 'raw',
          mapsel: [0, 0], ablate: '', rank: 1};
var LETTERS = {ln1: 'C, E', q: 'C, D', k: 'C, D', v: 'C, D', q_lin: 'C, D', k_lin: 'C, D',
  q_normed: 'C, D', k_normed: 'C, D', scores: 'C, C', scaled: 'C, C',
  masked: 'C, C', attn: 'C, C', out: 'C, D', contrib: 'C, E', attn_out: 'C, E',
  attn_concat: 'C, E', diff: 'C, E', avg: 'C, C', ffn_pre: 'C, F', ffn_gate: 'C, F',
  ffn_post: 'C, F', ffn_out: 'C, E'};

function $(id) { return document.getElementById(id); }
function el(tag, cls, text) {
  var e = document.createElement(tag);
  if (cls) { e.className = cls; }
  if (text !== undefined) { e.textContent = text; }
  return e;
}
function vis(t) {
  return t.replace(/ /g, '\u2423').replace(/\n/g, '\\n').replace(/\t/g, '\\t')
    .replace(/\r/g, '\\r') || '\u2205';
}
function tokOf(id) { var t = D.vocab[String(id)]; return t === undefined ? '#' + id : t; }
function fmt(v) {
  if (v === -Infinity) { return '\u2212\u221e'; }
  return Math.abs(v) >= 1e-3 || v === 0 ? v.toPrecision(7) : v.toExponential(6);
}
function short(v) { return v === -Infinity ? '\u2212\u221e' : v.toPrecision(4); }

/* --- tensors -------------------------------------------------------------------------- */
function decode(item) {
  var bin = atob(item.f32.replace(/-/g, '+').replace(/_/g, '/')), n = bin.length, u = new Uint8Array(n);
  for (var i = 0; i < n; i++) { u[i] = bin.charCodeAt(i); }
  return {shape: item.shape, a: new Float32Array(u.buffer)};
}
function tensor(name) {
  if (!T[name]) {
    if (!D.tensors[name]) { throw new Error('no tensor ' + name); }
    T[name] = decode(D.tensors[name]);
  }
  return T[name];
}
function mat(name) {
  var t = tensor(name), cols = t.shape[1];
  return {name: name, rows: t.shape[0], cols: cols,
          get: function (i, j) { return t.a[i * cols + j]; }};
}
function derived(name, rows, cols, get) { return {name: name, rows: rows, cols: cols, get: get}; }
function hp(l, h) { return 'layer' + l + '.head' + h + '.'; }
function nrep() { return D.sizes.H / (D.sizes.Hkv || D.sizes.H); }
/* the key/value head query head h reads, and the name its tensors go by (its first query head) */
function kvOf(h) { return Math.floor(h / nrep()); }
function kp(l, h) { return hp(l, kvOf(h) * nrep()); }
function has(name) { return !!D.tensors[name]; }
function inDetail(l) { return D.detail.indexOf(l) >= 0; }
function scaled(l, h) {
  var s = mat(hp(l, h) + 'scores'), r = Math.sqrt(D.sizes.D);
  return derived(hp(l, h) + 'scaled', s.rows, s.cols, function (i, j) { return s.get(i, j) / r; });
}
function masked(l, h) {
  var s = scaled(l, h);
  return derived(hp(l, h) + 'masked', s.rows, s.cols,
                 function (i, j) { return j > i ? -Infinity : s.get(i, j); });
}
function headAverage(l) {
  var H = D.sizes.H, ms = [];
  for (var h = 0; h < H; h++) { ms.push(mat(hp(l, h) + 'attn')); }
  return derived('layer' + l + '.avg', ms[0].rows, ms[0].cols, function (i, j) {
    var s = 0;
    for (var h = 0; h < H; h++) { s += ms[h].get(i, j); }
    return s / H;
  });
}
function stats(m) {
  var n = 0, s = 0, s2 = 0, mx = 0;
  for (var i = 0; i < m.rows; i++) {
    for (var j = 0; j < m.cols; j++) {
      var v = m.get(i, j);
      if (v === -Infinity) { continue; }
      n++; s += v; s2 += v * v; mx = Math.max(mx, Math.abs(v));
    }
  }
  var mean = s / n;
  return {mean: mean, variance: s2 / n - mean * mean, maxabs: mx};
}
function shapeOf(name) {
  var last = name.split('.').pop(), letters = LETTERS[last] || '';
  var nums = letters.split(', ').map(function (x) { return D.sizes[x]; });
  return '(' + letters + ') = (' + nums.join(', ') + ')';
}

/* --- heatmaps ------------------------------------------------------------------------- */
function colour(v, mode, scale) {
  if (v === -Infinity) { return '#d8d8d8'; }
  var t;
  if (mode === 'prob' || mode === 'log') {
    t = mode === 'log' ? Math.max(0, 1 + Math.log10(Math.max(v, 1e-6)) / 6) : Math.sqrt(v);
    return 'rgb(' + Math.round(255 - 225 * t) + ',' + Math.round(255 - 150 * t) + ',' +
      Math.round(255 - 60 * t) + ')';
  }
  t = scale > 0 ? Math.max(-1, Math.min(1, v / scale)) : 0;
  var w = Math.round(255 * (1 - Math.abs(t)));
  return t >= 0 ? 'rgb(255,' + w + ',' + w + ')' : 'rgb(' + w + ',' + w + ',255)';
}
function show(m, i, j) {
  var v = m.get(i, j), r = $('readout');
  var square = /\.(scores|scaled|masked|attn|avg)$/.test(m.name);
  var key = square ? ' key ' + vis(D.tokens[j]) : '';
  r.textContent = m.name + ' [' + i + ', ' + j + '] = ' + fmt(v) + '   (query ' +
    vis(D.tokens[i]) + key + ')';
  r.dataset.name = m.name; r.dataset.i = i; r.dataset.j = j; r.dataset.value = String(v);
}
function robust(m) {
  /* the 99th percentile of |value|: a colour scale not set by a few huge entries */
  var a = [];
  for (var i = 0; i < m.rows; i++) {
    for (var j = 0; j < m.cols; j++) { var v = m.get(i, j); if (v !== -Infinity) { a.push(Math.abs(v)); } }
  }
  a.sort(function (x, y) { return x - y; });
  return a.length ? a[Math.min(a.length - 1, Math.floor(0.99 * a.length))] : 0;
}
function legend(mode, scale, largest) {
  /* the colour scale of one heatmap: its colours from the lowest to the highest value */
  var box = el('div', 'legend'), bar = el('span', 'scale'), stops = [];
  for (var x = 0; x <= 10; x++) {
    var f = x / 10, v = mode === 'prob' ? f : mode === 'log' ? Math.pow(10, -6 + 6 * f)
      : (2 * f - 1) * scale;
    stops.push(colour(v, mode, scale));
  }
  bar.style.background = 'linear-gradient(to right,' + stops.join(',') + ')';
  var lo = mode === 'prob' ? '0' : mode === 'log' ? '10\u207b\u2076' : short(-scale);
  var hi = mode === 'prob' || mode === 'log' ? '1' : short(scale);
  if (largest) { lo = '\u2264' + lo; hi = '\u2265' + hi; }
  box.appendChild(el('span', 'lo', lo)); box.appendChild(bar); box.appendChild(el('span', 'hi', hi));
  box.appendChild(el('span', 'note', mode === 'prob' ? ' weight (colour \u221d \u221aweight)'
    : mode === 'log' ? ' weight, log scale' : largest
      ? ' red +, white 0, blue \u2212; clipped at the 99th percentile of |value| (a few ' +
        'entries are far larger: up to ' + short(largest) + ')'
      : ' red +, white 0, blue \u2212 (\u00b1 the largest |value|)'));
  box.dataset.lo = lo; box.dataset.hi = hi;
  return box;
}
function labels(cls, n, px, text) {
  /* token labels along one axis, every k-th where the cells are too small to read */
  var box = el('div', cls), every = Math.max(1, Math.ceil(9 / px));
  for (var i = 0; i < n; i += every) {
    var s = el('span', null, text(i));
    s.style[cls === 'ylab' ? 'top' : 'left'] = (i * px) + 'px';
    s.style.fontSize = Math.min(11, Math.max(8, px)) + 'px';
    s.dataset.pos = i;
    box.appendChild(s);
  }
  box.style[cls === 'ylab' ? 'height' : 'width'] = (n * px) + 'px';
  return box;
}
function heat(m, caption, opts) {
  opts = opts || {};
  var fig = el('figure'), cv = document.createElement('canvas');
  fig.appendChild(el('figcaption', null, caption + '  ' + shapeOf(m.name)));
  var px = Math.max(1, Math.min(opts.max || 16, Math.floor((opts.width || 520) / m.cols),
                                 Math.floor((opts.height || 400) / m.rows)));
  if (!opts.width && px < 3) {  /* a wide matrix (E or F columns): 3 px a cell, scrolled */
    px = Math.max(px, Math.min(3, Math.floor((opts.height || 400) / m.rows)));
  }
  cv.width = m.cols * px; cv.height = m.rows * px;
  cv.dataset.name = m.name; cv.dataset.rows = m.rows; cv.dataset.cols = m.cols;
  cv.dataset.px = px;
  var mode = opts.mode || 'signed', scale = mode === 'signed' ? stats(m).maxabs : 1, largest = 0;
  if (mode === 'signed') {
    var r99 = robust(m);
    if (r99 > 0 && scale > 4 * r99) { largest = scale; scale = r99; }
  }
  var g = cv.getContext('2d');
  for (var i = 0; i < m.rows; i++) {
    for (var j = 0; j < m.cols; j++) {
      g.fillStyle = colour(m.get(i, j), mode, scale);
      g.fillRect(j * px, i * px, px, px);
    }
  }
  if (opts.row !== undefined && opts.row < m.rows) {
    g.strokeStyle = '#d33'; g.lineWidth = 1;
    g.strokeRect(0.5, opts.row * px + 0.5, cv.width - 1, px - 1);
  }
  function at(e) { return [Math.floor(e.offsetY / px), Math.floor(e.offsetX / px)]; }
  cv.onmousemove = function (e) {
    var p = at(e);
    if (p[0] >= 0 && p[0] < m.rows && p[1] >= 0 && p[1] < m.cols) { show(m, p[0], p[1]); }
  };
  if (opts.onclick) {
    cv.onclick = function (e) { var p = at(e); if (p[0] < m.rows) { opts.onclick(p[0], p[1]); } };
  }
  /* axes: rows are query tokens (positions); the columns of a C x C map are key tokens */
  var square = /\.(scores|scaled|masked|attn|avg)$/.test(m.name);
  var tok = function (i) { return vis(D.tokens[i]); };
  var grid = el('div', 'hm'), right = el('div', 'hmbody');
  grid.appendChild(labels('ylab', m.rows, px, tok));
  if (square) { right.appendChild(labels('xlab', m.cols, px, tok)); }
  right.appendChild(cv);
  grid.appendChild(right);
  fig.appendChild(grid);
  fig.appendChild(legend(mode, scale, largest));
  return fig;
}
function fill(box, figs) {
  box.textContent = '';
  figs.forEach(function (f) { box.appendChild(f); });
}

/* --- views ---------------------------------------------------------------------------- */
function range(n) { var r = []; for (var i = 0; i < n; i++) { r.push(i); } return r; }
function rowRms(m) {
  return range(m.rows).map(function (i) {
    var s = 0;
    for (var j = 0; j < m.cols; j++) { s += m.get(i, j) * m.get(i, j); }
    return Math.sqrt(s / m.cols);
  });
}
function span(xs) {
  return short(Math.min.apply(null, xs)) + '\u2026' + short(Math.max.apply(null, xs));
}
function meanSquare(m) { var s = stats(m); return s.variance + s.mean * s.mean; }
/* the stage names of q and k in the order the model computes them */
function qStages() {
  var a = D.arch || {}, st2 = [];
  if (a.qk_norm || a.position === 'rope') { st2.push('_lin'); }
  if (a.qk_norm && a.position === 'rope') { st2.push('_normed'); }
  st2.push('');
  return st2;
}
function kvCaption(h) {
  var r = nrep();
  if (r === 1) { return ''; }
  var j = kvOf(h);
  return ' (key/value head ' + j + ' of ' + D.sizes.Hkv + ', shared by query heads ' +
    (j * r) + '\u2013' + (j * r + r - 1) + ')';
}
function buildSteps() {
  var a = D.arch || {norm: 'layernorm', position: 'learned', mlp: 'gelu'}, qs = qStages();
  var bias = a.qkv_bias === undefined ? true : a.qkv_bias, b = bias ? ' + b' : '';
  var norm = a.norm === 'rmsnorm'
    ? 'x = RMSNorm\u2081(h) = h / \u221a(mean(h\u00b2) + \u03b5) \u00b7 g'
    : 'x = LN\u2081(h) = (h \u2212 mean(h)) / \u221a(var(h) + \u03b5) \u00b7 g + b';
  var s = [{id: 'x', title: 'x', formula: norm + ': the residual stream h, normalised row by row',
            mats: function (l) { return [[mat('layer' + l + '.ln1'), 'x']]; }},
    {id: 'qkv', title: 'Q, K, V',
     formula: 'Q = x\u00b7W_q^i' + b + ',  K = x\u00b7W_k^j' + b + ',  V = x\u00b7W_v^j' + b +
       (nrep() > 1 ? '  (j = i // ' + nrep() + ': grouped-query attention)' : ''),
     mats: function (l, h) {
       return [[mat(hp(l, h) + 'q' + qs[0]), 'Q'], [mat(kp(l, h) + 'k' + qs[0]), 'K' + kvCaption(h)],
               [mat(kp(l, h) + 'v'), 'V' + kvCaption(h)]];
     }}];
  if (a.qk_norm) {
    var nq = a.position === 'rope' ? '_normed' : '';
    s.push({id: 'qknorm', title: 'QK-norm',
      formula: 'q \u2190 RMSNorm(q)\u00b7g_q,  k \u2190 RMSNorm(k)\u00b7g_k  (over each head\u2019s D)',
      mats: function (l, h) {
        return [[mat(hp(l, h) + 'q' + nq), 'RMSNorm(Q)'],
                [mat(kp(l, h) + 'k' + nq), 'RMSNorm(K)' + kvCaption(h)]];
      }});
  }
  if (a.position === 'rope') {
    var pre = qs[qs.length - 2];
    s.push({id: 'rope', title: 'RoPE',
      formula: 'q_m \u2190 R(m)\u00b7q_m,  k_n \u2190 R(n)\u00b7k_n: pair (d, d + D/2) of position m turned by m\u00b7\u03b8^(\u22122d/D), \u03b8 = ' +
        a.rope_theta,
      mats: function (l, h) {
        return [[mat(hp(l, h) + 'q' + pre), 'Q before'], [mat(hp(l, h) + 'q'), 'Q rotated'],
                [mat(kp(l, h) + 'k' + pre), 'K before' + kvCaption(h)],
                [mat(kp(l, h) + 'k'), 'K rotated']];
      }});
  }
  var rot = a.position === 'rope' ? ' (the rotated q and k)' : '';
  s = s.concat([
    {id: 'scores', title: 'Q\u00b7K\u1d40', formula: 'S = Q\u00b7K\u1d40: S_ab = q_a \u00b7 k_b' + rot,
     mats: function (l, h) { return [[mat(hp(l, h) + 'scores'), 'Q\u00b7K\u1d40']]; }},
    {id: 'scaled', title: '\u00f7 \u221aD', formula: 'S / \u221aD',
     mats: function (l, h) { return [[scaled(l, h), 'Q\u00b7K\u1d40/\u221aD']]; }},
    {id: 'masked', title: 'mask',
     formula: 'mask(S/\u221aD): \u2212\u221e above the diagonal (key b > query a)',
     mats: function (l, h) { return [[masked(l, h), 'masked']]; }},
    {id: 'softmax', title: 'softmax',
     formula: 'A = softmax(mask(Q\u00b7K\u1d40/\u221aD)), row by row',
     mats: function (l, h) { return [[mat(hp(l, h) + 'attn'), 'A', 'prob']]; }},
    {id: 'av', title: '\u00b7V', formula: 'R^i = A\u00b7V',
     mats: function (l, h) { return [[mat(hp(l, h) + 'out'), 'R^i']]; }},
    {id: 'wo', title: '\u00b7W_o', formula: 'R^i\u00b7W_o^i: head i\u2019s share of the attention output',
     mats: function (l, h) { return [[mat(hp(l, h) + 'contrib'), 'R^i\u00b7W_o^i']]; }},
    {id: 'ffn', title: 'FFN', formula: {
      gelu: 'FFN(x\u2082) = GELU(x\u2082\u00b7W_up' + b + ')\u00b7W_down' + b,
      relu2: 'FFN(x\u2082) = max(0, x\u2082\u00b7W_up)\u00b2\u00b7W_down  (ReLU\u00b2)',
      swiglu: 'FFN(x\u2082) = (SiLU(x\u2082\u00b7W_gate) \u2299 x\u2082\u00b7W_up)\u00b7W_down  (SwiGLU)'}[a.mlp] +
      ',  x\u2082 = the second norm of h + attention',
     mats: function (l) {
       var p = 'layer' + l + '.', out = [];
       if (a.mlp === 'swiglu') { out.push([mat(p + 'ffn_gate'), 'x\u2082\u00b7W_gate']); }
       out.push([mat(p + 'ffn_pre'), 'x\u2082\u00b7W_up' + (a.mlp === 'swiglu' ? '' : b)]);
       out.push([mat(p + 'ffn_post'), a.mlp === 'swiglu' ? 'SiLU(gate) \u2299 up'
                 : a.mlp === 'relu2' ? 'ReLU\u00b2' : 'GELU']);
       out.push([mat(p + 'ffn_out'), 'FFN output (added to h)']);
       return out;
     }}]);
  s.forEach(function (x, i) { x.title = (i + 1) + '. ' + x.title; });
  return s;
}
var STEPS = [];
function normNote(l) {
  var n = D.norms[String(l)], E = D.sizes.E, rms = n.kind === 'rmsnorm', g2 = n.g_rms * n.g_rms;
  return 'Each row is one token, its E = ' + E + ' numbers; the columns are directions of ' +
    'the residual stream in no meaningful order, so no picture across them is expected: ' +
    'compare rows, or hover a cell. The norm works row by row: rows of h (the stream ' +
    'entering layer ' + l + ') have RMS ' + span(n.h_rms) +
    (rms ? '' : ' around means ' + span(n.h_mean)) + '; ' +
    (rms ? 'dividing by their RMS' : 'subtracting the mean and dividing by the standard deviation') +
    ' gives rows of RMS ' + span(n.n_rms) + ' (1 up to the \u03b5 inside the root), which the learned gain g (RMS ' +
    short(n.g_rms) + ') then scales channel by channel: rows of x have RMS ' + span(n.x_rms) +
    '. So the variance over all entries goes from ' + short(n.h_var) + ' (h) to ' +
    short(n.x_var) + ' (x), not 1: x is n times the learned gain. Were g unrelated to which ' +
    'channels of n are large, it would be about RMS(g)\u00b2 = ' + short(g2) + '; it is ' +
    (Math.abs(n.x_var - g2) <= 0.1 * g2 ? 'close to that'
      : n.x_var < g2 ? 'smaller: the gain is smaller on the channels where n is large'
        : 'larger: the gain is larger on the channels where n is large') +
    (rms ? '' : ' (and the bias b adds its share)') + '.';
}
function scaledNote(l, h, el2) {
  var a = stats(mat(hp(l, h) + 'scores')).variance, b = stats(scaled(l, h)).variance;
  var mq = meanSquare(mat(hp(l, h) + 'q')), mk = meanSquare(mat(kp(l, h) + 'k'));
  el2.dataset.varRaw = String(a); el2.dataset.varScaled = String(b);
  el2.dataset.qq = String(mq); el2.dataset.kk = String(mk);
  return 'variance over all C\u00d7C entries: Q\u00b7K\u1d40 ' + short(a) + ' \u2192 Q\u00b7K\u1d40/\u221aD ' +
    short(b) + ' (divided by exactly D = ' + D.sizes.D + '). Why not about 1: the note\u2019s ' +
    'argument assumes entries of q and k independent with mean 0 and variance 1, so that ' +
    'q\u00b7k has variance D. Here E[q\u00b2] = ' + short(mq) + ' and E[k\u00b2] = ' + short(mk) +
    ', so independent entries would give Var(S/\u221aD) \u2248 E[q\u00b2]\u00b7E[k\u00b2] = ' +
    short(mq * mk) + '; the rest of the gap is that q and k are not independent (a trained ' +
    'head makes some q\u00b7k large on purpose). \u221aD removes the growth with D, not the scale.';
}
function ropeNote(l, h) {
  var qs = qStages(), pre = mat(hp(l, h) + 'q' + qs[qs.length - 2]), post = mat(hp(l, h) + 'q');
  var a = rowRms(pre), b = rowRms(post), worst = 0;
  for (var i = 0; i < a.length; i++) { worst = Math.max(worst, Math.abs(a[i] - b[i])); }
  return 'A rotation keeps each row\u2019s length: max |RMS(q_m rotated) \u2212 RMS(q_m)| = ' +
    worst.toExponential(1) + '. Row 0 is not turned (angle 0); later rows turn by more. ' +
    'So R(m)q\u00b7R(n)k = q\u00b7R(n \u2212 m)k: the scores see positions only through m \u2212 n.';
}
function ffnNote(l) {
  var p = mat('layer' + l + '.ffn_post'), zero = 0, a = D.arch || {};
  for (var i = 0; i < p.rows; i++) {
    for (var j = 0; j < p.cols; j++) { if (p.get(i, j) === 0) { zero++; } }
  }
  var frac = (100 * zero / (p.rows * p.cols)).toFixed(1) + ' %';
  return 'F = ' + D.sizes.F + ' hidden units per token. ' + (a.mlp === 'relu2'
    ? frac + ' of the hidden values are exactly 0 (ReLU\u00b2 keeps only positive inputs, squared).'
    : a.mlp === 'swiglu' ? 'SiLU(gate) (at least \u22120.28) decides per unit how much of up passes.'
    : 'GELU passes positive inputs and damps negative ones (at least \u22120.17).') +
    ' The output is added to the residual stream.';
}
function stepNote(id, l, h) {
  var el2 = $('step-note');
  if (id === 'x') { return normNote(l); }
  if (id === 'scores' || id === 'scaled') { return scaledNote(l, h, el2); }
  if (id === 'rope') { return ropeNote(l, h); }
  if (id === 'ffn') { return ffnNote(l); }
  if (id === 'qkv' && nrep() > 1) {
    return 'Grouped-query attention: ' + D.sizes.H + ' query heads, ' + D.sizes.Hkv +
      ' key/value heads; query head ' + h + ' reads key/value head ' + kvOf(h) + '.';
  }
  if (id === 'softmax') {
    var A = mat(hp(l, h) + 'attn'), worst = 0;
    for (var i = 0; i < A.rows; i++) {
      var s = 0;
      for (var j = 0; j < A.cols; j++) { s += A.get(i, j); }
      worst = Math.max(worst, Math.abs(s - 1));
    }
    return 'every row sums to 1: max |\u03a3_b A_ab \u2212 1| = ' + worst.toExponential(1) +
      '; the masked entries are exactly 0';
  }
  if (id === 'masked') { return 'e^\u2212\u221e = 0: a query never sees a later key'; }
  return '';
}
function missing(box, l) {
  /* a layer whose step-by-step tensors this page does not carry */
  var d = D.detail, msg = 'This page carries the step-by-step tensors of layer' +
    (d.length > 1 ? 's ' + d[0] + '\u2013' + d[d.length - 1] : ' ' + d[0]) +
    ' (the maps, logit lens, low-rank spectra and whole-layer ablations cover all ' +
    D.sizes.L + '). ';
  msg += CFG.endpoint ? 'Fetching layer ' + l + '\u2026'
    : 'Write the page with --layer ' + l + ' to open this one, or use the live page of ' +
      'tinylm serve (/explorer), which fetches any layer.';
  box.textContent = '';
  var p = el('p', 'result missing', msg);
  p.dataset.layer = l;
  box.appendChild(p);
  if (CFG.endpoint) { fetchLayer(l); }
}
function renderSteps() {
  var box = $('steps');
  if (!box.childElementCount) {
    STEPS.forEach(function (s) {
      var b = el('button', null, s.title);
      b.dataset.step = s.id;
      b.onclick = function () { st.step = s.id; render(); };
      box.appendChild(b);
    });
  }
  if (!STEPS.some(function (x) { return x.id === st.step; })) { st.step = 'x'; }
  Array.prototype.forEach.call(box.children, function (b) {
    b.classList.toggle('on', b.dataset.step === st.step);
  });
  var s = STEPS.filter(function (x) { return x.id === st.step; })[0];
  $('step-title').textContent = s.title + '  \u2014  layer ' + st.layer +
    (s.id === 'x' || s.id === 'ffn' ? '' : ', head ' + st.head);
  $('step-formula').textContent = s.formula;
  if (!inDetail(st.layer)) {
    $('step-note').textContent = '';
    missing($('step-maps'), st.layer);
    return;
  }
  $('step-note').textContent = stepNote(s.id, st.layer, st.head);
  fill($('step-maps'), s.mats(st.layer, st.head).map(function (p) {
    return heat(p[0], p[1], {mode: p[2], row: st.query});
  }));
}
function renderHeads() {
  var l = st.layer, H = D.sizes.H, each = [];
  $('heads-title').textContent = 'layer ' + l + ': all ' + H + ' heads';
  if (!inDetail(l)) {
    $('heads-diff').textContent = ''; fill($('heads-forms'), []);
    missing($('heads-each'), l);
    return;
  }
  for (var h = 0; h < H; h++) {
    var col = el('div');
    col.appendChild(heat(mat(hp(l, h) + 'attn'), 'A of head ' + h + kvCaption(h),
                         {mode: 'prob', max: 6, width: 200}));
    col.appendChild(heat(mat(hp(l, h) + 'contrib'), 'R^' + h + '\u00b7W_o^' + h,
                         {max: 2, width: 260}));
    each.push(col);
  }
  fill($('heads-each'), each);
  var sum = mat('layer' + l + '.attn_out'), cat = mat('layer' + l + '.attn_concat');
  var diff = derived('layer' + l + '.diff', sum.rows, sum.cols,
                     function (i, j) { return sum.get(i, j) - cat.get(i, j); });
  var d = stats(diff).maxabs;
  var out = $('heads-diff');
  out.textContent = 'max |sum form \u2212 concat form| = ' + d.toExponential(2) +
    ' (float32 rounding: the two forms are the same product)';
  out.dataset.maxdiff = String(d);
  fill($('heads-forms'), [heat(sum, 'sum form'), heat(cat, 'concat form'),
                          heat(diff, 'difference')]);
}
function renderMaps() {
  var grid = $('maps-grid'), L = D.sizes.L, H = D.sizes.H, table = el('table');
  var avg = st.mapmode === 'avg';
  for (var l = 0; l < L; l++) {
    var tr = el('tr');
    tr.appendChild(el('th', null, 'layer ' + l));
    for (var h = 0; h < (avg ? 1 : H); h++) {
      var td = el('td'), m = avg ? headAverage(l) : mat(hp(l, h) + 'attn');
      var sel = st.mapsel[0] === l && (avg || st.mapsel[1] === h);
      td.appendChild(heat(m, avg ? 'mean of heads' : 'head ' + h, {
        mode: st.mapmode === 'log' ? 'log' : 'prob', max: 8, width: 180, height: 180,
        row: sel ? st.query : undefined,
        onclick: (function (ll, hh) {
          return function (i) { st.query = i; st.mapsel = [ll, hh]; render(); };
        })(l, h)}));
      tr.appendChild(td);
    }
    table.appendChild(tr);
  }
  grid.textContent = ''; grid.appendChild(table);
  var ml = st.mapsel[0], mh = avg ? -1 : st.mapsel[1];
  var m2 = mh < 0 ? headAverage(ml) : mat(hp(ml, mh) + 'attn'), q = st.query;
  $('maps-row-title').textContent = 'row of query ' + q + ' (' + vis(D.tokens[q]) + ') in layer ' +
    ml + (mh < 0 ? ', mean of heads' : ', head ' + mh);
  var rows = $('maps-row');
  rows.textContent = '';
  rows.appendChild(headRow(['key', 'token', 'weight', '']));
  for (var j = 0; j <= q; j++) {
    var w = m2.get(q, j);
    rows.appendChild(barRow([String(j), vis(D.tokens[j]), w.toFixed(4)], w));
  }
}
function headRow(cells) {
  var tr = el('tr');
  cells.forEach(function (c) { tr.appendChild(el('th', null, c)); });
  return tr;
}
function barRow(cells, p, extra) {
  var tr = el('tr');
  cells.forEach(function (c) { tr.appendChild(el('td', null, c)); });
  var td = el('td'), bar = el('span', 'bar');
  bar.style.width = Math.round(160 * p) + 'px';
  td.appendChild(bar); tr.appendChild(td);
  if (extra) { tr.appendChild(el('td', null, extra)); }
  return tr;
}
function candCell(c) {
  var td = el('td'), bar = el('span', 'bar');
  td.appendChild(document.createTextNode(vis(tokOf(c[0])) + ' ' + c[1].toFixed(4)));
  bar.style.width = Math.round(80 * c[1]) + 'px';
  td.appendChild(bar);
  td.dataset.id = c[0]; td.dataset.prob = String(c[1]);
  return td;
}
function nextTable(box, top, kept) {
  box.textContent = '';
  var k = top[0].length, head = ['t', 'token'];
  for (var c = 0; c < k; c++) { head.push('#' + (c + 1)); }
  if (kept) { head.push('p(original top)'); }
  box.appendChild(headRow(head));
  top.forEach(function (row, t) {
    var tr = el('tr');
    tr.appendChild(el('td', null, String(t)));
    tr.appendChild(el('td', null, vis(D.tokens[t])));
    row.forEach(function (c) { tr.appendChild(candCell(c)); });
    if (kept) {
      var base = D.next[t][0];
      if (row[0][0] !== base[0]) { tr.className = 'changed'; }
      tr.appendChild(el('td', null, vis(tokOf(base[0])) + ' ' + base[1].toFixed(4) +
                        ' \u2192 ' + kept[t].toFixed(4)));
    }
    box.appendChild(tr);
  });
}
function renderLens() {
  var box = $('lens-table');
  box.textContent = '';
  box.appendChild(headRow(['t', 'token'].concat(D.lens.map(function (s) { return s.label; }))));
  D.ids.forEach(function (id, t) {
    var tr = el('tr');
    tr.appendChild(el('td', null, String(t)));
    tr.appendChild(el('td', null, vis(D.tokens[t])));
    D.lens.forEach(function (s) {
      var c = s.top[t][0], td = el('td', null, vis(tokOf(c[0])) + ' ' + c[1].toFixed(3));
      var all = s.top[t].map(function (x) { return vis(tokOf(x[0])) + ' ' + x[1].toFixed(4); });
      td.title = s.label + ', after "' + D.tokens.slice(0, t + 1).join('') + '": ' + all.join(', ');
      td.dataset.id = c[0];
      td.style.background = 'rgba(42,170,102,' + (0.1 + 0.6 * c[1]).toFixed(3) + ')';
      td.onmouseenter = function () { $('readout').textContent = td.title; };
      tr.appendChild(td);
    });
    box.appendChild(tr);
  });
}
function ablationLabel(key) {
  var p = key.split('.'), l = p[0].slice(5);
  if (p[1] === 'attn') { return 'layer ' + l + ' attention (all heads)'; }
  if (p[1] === 'ffn') { return 'layer ' + l + ' FFN'; }
  return 'layer ' + l + ' head ' + p[1].slice(4);
}
function renderAblation() {
  var sel = $('ablate');
  if (sel.options.length !== D.ablations.length + 1) {
    sel.textContent = '';
    sel.add(new Option('nothing (the model as it is)', ''));
    D.ablations.forEach(function (a) { sel.add(new Option(ablationLabel(a.key), a.key)); });
    sel.onchange = function () { st.ablate = sel.value; render(); };
  }
  sel.value = st.ablate;
  var a = D.ablations.filter(function (x) { return x.key === st.ablate; })[0];
  $('ablation-note').textContent = a ? 'next-token table with ' + ablationLabel(a.key) +
    ' switched off (precomputed); highlighted rows changed their top token; last column: ' +
    'the probability left to the original top token'
    : 'pick a part to switch off; every table is precomputed, no server needed' +
      (D.ablations.length < D.sizes.L * (D.sizes.H + 2)
        ? ' (single heads: of the layers whose steps the page carries' +
          (CFG.endpoint ? ', and of each layer the live page fetches)' : ')') : '');
  nextTable($('ablation-table'), a ? a.top : D.next, a ? a.orig_top_prob : null);
}
function renderLowrank() {
  var key = 'layer' + st.layer + '.head' + st.head, lr = D.lowrank[key], Dd = D.sizes.D;
  var slider = $('rank');
  slider.max = Dd;
  st.rank = Math.min(st.rank, Dd);
  slider.value = st.rank;
  slider.oninput = function () { st.rank = +slider.value; renderLowrank(); };
  $('lowrank-title').textContent = 'layer ' + st.layer + ', head ' + st.head +
    ': singular values of W_v^i\u00b7W_o^i (' + D.sizes.E + ' \u00d7 ' + D.sizes.E + ', rank \u2264 D = ' +
    Dd + ')';
  var bars = $('lowrank-bars'), top = lr.singular[0] || 1;
  bars.textContent = '';
  lr.singular.forEach(function (s, j) {
    var b = el('div', j < st.rank ? '' : 'drop');
    b.style.height = Math.max(1, Math.round(130 * s / top)) + 'px';
    b.title = 's_' + (j + 1) + ' = ' + fmt(s);
    bars.appendChild(b);
  });
  $('rank-value').textContent = st.rank + ' of ' + Dd;
  var out = $('lowrank-error'), we = lr.weight_error[st.rank], oe = lr.output_error[st.rank];
  out.textContent = 'keep r = ' + st.rank + ': \u2016M \u2212 M_r\u2016/\u2016M\u2016 = ' + we.toFixed(4) +
    ';  this head\u2019s output on the prompt, \u2016A\u00b7(x\u00b7M_r + b)\u2212R^i\u00b7W_o^i\u2016/\u2016R^i\u00b7W_o^i\u2016 = ' +
    oe.toFixed(4);
  out.dataset.weightError = String(we); out.dataset.outputError = String(oe);
}
function renderTokens() {
  var box = $('tokens');
  box.textContent = '';
  D.tokens.forEach(function (t, i) {
    var s = el('span', 'tok' + (i === st.query ? ' sel' : ''), vis(t));
    s.title = 'position ' + i + ', id ' + D.ids[i];
    s.dataset.pos = i;
    s.onclick = function () { st.query = i; render(); };
    box.appendChild(s);
  });
}
var VIEWS = {steps: renderSteps, heads: renderHeads, maps: renderMaps, lens: renderLens,
             ablation: renderAblation, lowrank: renderLowrank,
             next: function () { nextTable($('next-table'), D.next, null); }};
function render() {
  if (!D) { return; }
  $('layer').value = st.layer; $('head').value = st.head;
  renderTokens();
  Array.prototype.forEach.call(document.querySelectorAll('#views button'), function (b) {
    b.classList.toggle('on', b.dataset.view === st.view);
    $('view-' + b.dataset.view).hidden = b.dataset.view !== st.view;
  });
  var r = $('readout');
  r.textContent = 'hover a matrix to read its values';
  delete r.dataset.name; delete r.dataset.value;
  VIEWS[st.view]();
  document.body.dataset.view = st.view;
}

/* --- loading -------------------------------------------------------------------------- */
function merge(part) {
  /* a layer's step-by-step part fetched by the live page: tensors, norms, head ablations */
  Object.keys(part.tensors).forEach(function (k) { D.tensors[k] = part.tensors[k]; delete T[k]; });
  Object.keys(part.norms).forEach(function (k) { D.norms[k] = part.norms[k]; });
  Object.keys(part.vocab || {}).forEach(function (k) { D.vocab[k] = part.vocab[k]; });
  part.detail.forEach(function (l) { if (!inDetail(l)) { D.detail.push(l); } });
  D.detail.sort(function (x, y) { return x - y; });
  var known = {};
  D.ablations.forEach(function (a) { known[a.key] = true; });
  D.ablations = D.ablations.concat((part.ablations || []).filter(function (a) { return !known[a.key]; }));
  var order = function (k) { var p = k.split('.'), l = +p[0].slice(5);
    return l * 1000 + (p[1] === 'attn' ? 900 : p[1] === 'ffn' ? 901 : +p[1].slice(4)); };
  D.ablations.sort(function (x, y) { return order(x.key) - order(y.key); });
}
var pending = {};
/* The live page's key: the one the server page (/) keeps for this tab in sessionStorage
   (never localStorage), or typed here; sent as "Authorization: Bearer KEY". */
var KEY = 'tinylm-key';
function stored(value) {  /* read (or, given a value, write) the tab's key; '' without storage */
  try {
    if (value) { sessionStorage.setItem(KEY, value); }
    return sessionStorage.getItem(KEY) || '';
  } catch (e) { return value || ''; }
}
function apiKey() { return stored($('key-input').value.trim()); }
function failure(r, text) {
  /* the server's own message (OpenAI's {"error": {"message"}}), else its status */
  var msg = '';
  try { var j = JSON.parse(text); msg = (j.error && j.error.message) || j.detail || ''; }
  catch (e) { msg = text.trim().slice(0, 300); }
  msg = 'the server answered ' + r.status + (r.statusText ? ' ' + r.statusText : '') +
    (msg ? ': ' + msg : '');
  if (r.status === 401) {
    $('key-label').className = 'needed'; $('key-input').focus();
    msg += ' (enter the server\'s API key)';
  }
  return new Error(msg);
}
function post(body) {
  var headers = {'Content-Type': 'application/json'}, key = apiKey();
  if (key) { headers.Authorization = 'Bearer ' + key; }
  return fetch(CFG.endpoint, {method: 'POST', headers: headers, body: JSON.stringify(body)})
    .then(function (r) {
      return r.text().then(function (text) {
        if (!r.ok) { throw failure(r, text); }
        $('key-label').className = '';
        return JSON.parse(text);
      });
    });
}
function report(err) {
  var status = $('live-status');
  status.className = 'note error'; status.textContent = String(err.message || err);
}
function fetchLayer(l) {
  if (pending[l] || !D.prompt) { return; }
  pending[l] = true;
  var status = $('live-status'), mine = D;
  status.textContent = 'fetching layer ' + l + '\u2026';
  post({prompt: D.prompt, top_k: D.next[0].length, layers: [l]}).then(function (part) {
    delete pending[l];
    if (D !== mine) { return; }
    merge(part); status.textContent = ''; render();
  }).catch(function (err) { delete pending[l]; report(err); });
}
function load(data) {
  D = data; T = {}; pending = {};
  var s = D.sizes, ls = $('layer'), hs = $('head');
  ls.textContent = ''; hs.textContent = ''; $('ablate').textContent = '';
  STEPS = buildSteps(); $('steps').textContent = '';
  for (var l = 0; l < s.L; l++) { ls.add(new Option('layer ' + l, l)); }
  for (var h = 0; h < s.H; h++) { hs.add(new Option('head ' + h, h)); }
  st.layer = Math.min(D.select.layer, s.L - 1); st.head = Math.min(D.select.head, s.H - 1);
  st.query = D.ids.length - 1; st.mapsel = [st.layer, st.head]; st.ablate = '';
  st.rank = Math.max(1, Math.floor(s.D / 4));
  var a = D.arch || {};
  var parts = [a.norm === 'rmsnorm' ? 'RMSNorm' : 'LayerNorm',
    a.position === 'rope' ? 'RoPE (\u03b8 = ' + a.rope_theta + ')' : 'learned positions',
    {gelu: 'GELU', relu2: 'ReLU\u00b2', swiglu: 'SwiGLU'}[a.mlp] + ' FFN (F = ' + s.F + ')',
    s.Hkv && s.Hkv !== s.H ? 'grouped-query attention (' + s.H + ' query, ' + s.Hkv +
      ' key/value heads)' : 'multi-head attention'];
  if (a.qk_norm) { parts.push('QK-norm'); }
  parts.push(a.tied === false ? 'untied LM head' : 'LM head tied to the embedding');
  $('summary').textContent = 'C = ' + s.C + ' tokens, ' + s.L + ' layers, H = ' + s.H +
    ' heads, E = ' + s.E + ', D = ' + s.D + ', V = ' + s.V + '.  ' + parts.join(', ') +
    '.  Hover a matrix for its exact values; click a token to choose the query row.';
  render();
}
$('layer').onchange = function () { st.layer = +this.value; st.mapsel[0] = st.layer; render(); };
$('head').onchange = function () { st.head = +this.value; st.mapsel[1] = st.head; render(); };
Array.prototype.forEach.call(document.querySelectorAll('#views button'), function (b) {
  b.onclick = function () { st.view = b.dataset.view; render(); };
});
Array.prototype.forEach.call(document.querySelectorAll('input[name=mapmode]'), function (r) {
  r.onchange = function () { st.mapmode = r.value; render(); };
});
if (CFG.endpoint) {
  var form = $('live');
  form.hidden = false;
  $('key-input').value = stored();
  $('prompt-input').onkeydown = function (e) {  /* Ctrl+Enter (or Cmd+Enter) runs it */
    if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) { e.preventDefault(); form.requestSubmit(); }
  };
  form.onsubmit = function (e) {
    e.preventDefault();
    var status = $('live-status'), body = {prompt: $('prompt-input').value,
                                           top_k: +$('topk-input').value};
    if (st.layer || st.head) { body.layer = st.layer; body.head = st.head; }
    status.className = 'note'; status.textContent = 'computing\u2026';
    post(body).then(function (data) { status.textContent = ''; load(data); }).catch(report);
  };
}
var embedded = JSON.parse(document.getElementById('data').textContent);
window.tinylmExplorer = {state: st, load: load, data: function () { return D; }};
if (embedded) {
  if (CFG.endpoint && embedded.prompt) { $('prompt-input').value = embedded.prompt; }
  load(embedded);
} else if (CFG.endpoint) {
  $('summary').textContent = 'Type a prompt and press explain (or Ctrl+Enter): the model ' +
    'runs on it and every step of its attention shows here, layer by layer and head by head.';
}
})();
