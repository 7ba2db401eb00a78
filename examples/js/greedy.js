// A greedy text-completion inferlet in JavaScript, built from wit/pastry.wit (world
// `inferlet`) into a WebAssembly component with componentize-qjs (see build.sh).
//
// args: [comma-separated prompt token ids, number of new tokens]; returns the new token
// ids, comma-separated. Same algorithm as GREEDY_LOOP in tests/test_inferlets.py.
import api from "pastry:inferlet/api@0.1.0";

// Queued calls return a `pending` handle; block on it, then take its value (throws the
// error string on `err`).
function wait(p) {
  while (api.wait([p], null).length === 0) {}
  return api.take(p);
}

export function run(args) {
  if (args.length !== 2) {
    throw "usage: greedy <token,token,...> <n-new>";
  }
  const tokens = args[0].split(",").map((t) => parseInt(t, 10));
  const nNew = parseInt(args[1], 10);
  const model = api.availableModels()[0];
  const q = api.createQueue(model, -1);
  const ps = api.getKvPageSize(q);
  const n = tokens.length;
  const kv = api.allocKvpages(q, Math.floor((n + nNew + ps - 1) / ps));
  const emb = api.allocEmbeds(q, n + 1);
  const positions = tokens.map((_, i) => i);
  wait(api.embedTxt(q, tokens, positions, emb.slice(0, n)));
  wait(api.forward(q, [], 0, emb.slice(0, n), kv, 0, [emb[n]], null, null, 0, null));
  const out = [];
  let length = n;
  for (let step = 0; step < nNew; step++) {
    const v = wait(api.getNextDist(q, emb[n], 256, null));
    if (v.tag !== "dist") throw `get-next-dist returned ${v.tag}`;
    const [ids, probs] = v.val;
    let best = 0;
    for (let i = 1; i < probs.length; i++) if (probs[i] > probs[best]) best = i;
    const tok = ids[best];
    out.push(tok);
    wait(api.embedTxt(q, [tok], [length], [emb[0]]));
    const ctx = kv.slice(0, Math.floor((length + ps - 1) / ps));
    const last = length - (ctx.length - 1) * ps;
    wait(api.forward(q, ctx, last, [emb[0]], kv.slice(Math.floor(length / ps)), length % ps, [emb[n]], null, null, 0, null));
    length += 1;
  }
  return out.join(",");
}
