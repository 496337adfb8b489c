#!/usr/bin/env node
// Checks of replayssm's deployment files (run by ctest, see deploy/CMakeLists.txt):
//   node validate.js k8s        schema-validate every manifest in deploy/k8s (kubernetes-models,
//                               @kubernetes-models/prometheus-operator), reject unknown fields,
//                               and check what matters for this service (gRPC probes, one GPU,
//                               ports = the config's addresses, preStop + grace period, PDB
//                               and monitor selectors match the pods, PrometheusRule = alerts.yml)
//   node validate.js grafana    the dashboard is valid JSON, every panel has a query, and every
//                               query names only metrics the server exports
//   node validate.js alerts     every alert has firing and not-firing promtool tests, a runbook
//                               section in docs/operations.md, and names only known metrics
//   node validate.js dockerfile the Dockerfile's must-haves (multi-stage CUDA devel -> runtime,
//                               non-root USER, HEALTHCHECK, ENTRYPOINT, build script, the
//                               verbs providers RDMA needs)
//   node validate.js selftest   breaks the real files in memory, one fault at a time, and
//                               checks that each fault is reported (every check can fail)
// Module lookup: NODE_PATH may point at an `npm ci` of deploy/tools/package.json elsewhere.
'use strict';

const fs = require('fs');
const path = require('path');
const yaml = require('js-yaml');

const ROOT = path.resolve(__dirname, '..', '..');
const DEPLOY = path.join(ROOT, 'deploy');
const GPU = 'nvidia.com/gpu';
const PROMQL_WORDS = new Set([
  'sum', 'avg', 'min', 'max', 'count', 'rate', 'irate', 'increase', 'by', 'without', 'on',
  'ignoring', 'group_left', 'group_right', 'and', 'or', 'unless', 'histogram_quantile',
  'clamp_min', 'clamp_max', 'abs', 'absent', 'time', 'vector', 'scalar', 'topk', 'bottomk',
  'delta', 'deriv', 'le', 'offset', 'bool', 'label_replace', 'avg_over_time',
  'max_over_time', 'min_over_time', 'sum_over_time', 'changes', 'resets',
]);

// ---------------------------------------------------------------------------------------------
// Small helpers

function readYamlDocs(file) {
  return yaml.loadAll(fs.readFileSync(file, 'utf8')).filter((d) => d != null);
}

function loadManifests(dir) {
  const out = [];
  for (const name of fs.readdirSync(dir).sort()) {
    if (!/\.ya?ml$/.test(name) || name === 'kustomization.yaml') continue;
    for (const doc of readYamlDocs(path.join(dir, name))) out.push({ file: name, doc });
  }
  return out;
}

const clone = (x) => JSON.parse(JSON.stringify(x));

// Parses the server's `name = value` config format (service/config.cc).
function parseConf(text) {
  const conf = {};
  for (const raw of text.split('\n')) {
    const line = raw.replace(/#.*/, '').trim();
    if (!line) continue;
    const eq = line.indexOf('=');
    if (eq < 0) throw new Error(`config line without '=': ${raw}`);
    conf[line.slice(0, eq).trim()] = line.slice(eq + 1).trim();
  }
  return conf;
}

function portOf(address) {
  const m = /:(\d+)$/.exec(address || '');
  return m ? Number(m[1]) : NaN;
}

function matches(selector, labels) {
  const want = (selector && selector.matchLabels) || {};
  return Object.keys(want).length > 0 &&
      Object.entries(want).every(([k, v]) => labels && labels[k] === v);
}

// ---------------------------------------------------------------------------------------------
// Schema validation with unknown-field detection. The generated validators read every property
// that the schema knows (and enumerate the keys of free-form maps); a key of the manifest that
// the validator never touched is not in the schema: a typo or a misplaced field.

function tracked(value, p, seen) {
  if (value === null || typeof value !== 'object') return value;
  return new Proxy(value, {
    get(t, k, r) {
      const v = Reflect.get(t, k, r);
      if (typeof k !== 'string') return v;
      seen.add(`${p}/${k}`);
      return v !== null && typeof v === 'object' ? tracked(v, `${p}/${k}`, seen) : v;
    },
    has(t, k) {
      if (typeof k === 'string') seen.add(`${p}/${k}`);
      return Reflect.has(t, k);
    },
    ownKeys(t) {
      for (const k of Reflect.ownKeys(t)) if (typeof k === 'string') seen.add(`${p}/${k}`);
      return Reflect.ownKeys(t);
    },
  });
}

function unknownFields(value, p, seen, out) {
  if (value === null || typeof value !== 'object') return;
  for (const k of Object.keys(value)) {
    const kp = `${p}/${k}`;
    if (!seen.has(kp)) out.push(kp);
    else unknownFields(value[k], kp, seen, out);
  }
}

function modelFor(doc) {
  const { apiVersion, kind } = doc;
  if (apiVersion === 'monitoring.coreos.com/v1') {
    return require('@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1')[kind];
  }
  const group = apiVersion.includes('/') ? apiVersion : apiVersion;  // "v1" or "apps/v1"
  return require(`kubernetes-models/${group}`)[kind];
}

function schemaErrors(doc) {
  const Model = doc.apiVersion && doc.kind ? modelFor(doc) : undefined;
  if (!Model) return [`no schema for ${doc.apiVersion} ${doc.kind}`];
  const errors = [];
  const model = new Model(clone(doc));
  try {
    model.validate();
  } catch (e) {
    errors.push(e.message);
  }
  const seen = new Set();
  try {
    Model.prototype.validate.call(tracked(model.toJSON(), '', seen));
  } catch (e) {
    // reported above
  }
  const unknown = [];
  unknownFields(doc, '', seen, unknown);
  for (const u of unknown) errors.push(`unknown field ${u}`);
  return errors;
}

// ---------------------------------------------------------------------------------------------
// Service-specific checks on the set of manifests.

function checkService(manifests, alertsDoc) {
  const errs = [];
  const byKind = (k) => manifests.filter((m) => m.doc.kind === k).map((m) => m.doc);
  const [dep] = byKind('Deployment');
  const [svc] = byKind('Service');
  const [pdb] = byKind('PodDisruptionBudget');
  const [cm] = byKind('ConfigMap');
  const monitors = [...byKind('PodMonitor'), ...byKind('ServiceMonitor')];
  const [rule] = byKind('PrometheusRule');
  for (const [what, x] of [['Deployment', dep], ['Service', svc], ['PodDisruptionBudget', pdb],
    ['ConfigMap', cm], ['PodMonitor or ServiceMonitor', monitors[0]],
    ['PrometheusRule', rule]]) {
    if (!x) errs.push(`missing a ${what}`);
  }
  if (errs.length) return errs;

  const pod = dep.spec.template;
  const podLabels = pod.metadata.labels || {};
  if (!matches(dep.spec.selector, podLabels)) errs.push('Deployment selector does not match its pod labels');
  const c = (pod.spec.containers || []).find((x) => x.name === 'replayssm');
  if (!c) return errs.concat('Deployment has no container named replayssm');

  // Config: the ConfigMap's replayssm.conf, mounted where the container's --config points.
  const confText = cm.data && cm.data['replayssm.conf'];
  if (!confText) return errs.concat('ConfigMap has no replayssm.conf');
  const conf = parseConf(confText);
  const args = c.args || [];
  const ci = args.indexOf('--config');
  const confPath = ci >= 0 ? args[ci + 1] : undefined;
  if (!confPath) errs.push('container args lack --config FILE');
  const mount = (c.volumeMounts || []).find((m) => confPath && confPath.startsWith(`${m.mountPath}/`));
  const vol = mount && (pod.spec.volumes || []).find((v) => v.name === mount.name);
  if (!vol || !vol.configMap || vol.configMap.name !== cm.metadata.name) {
    errs.push(`--config ${confPath} is not a file of the ConfigMap ${cm.metadata.name}`);
  } else if (path.posix.basename(confPath) !== 'replayssm.conf') {
    errs.push(`--config ${confPath} does not name the ConfigMap key replayssm.conf`);
  }
  for (const key of ['grpc-address', 'metrics-address']) {
    const host = (conf[key] || '').replace(/:\d+$/, '');
    if (!['0.0.0.0', '[::]', ''].includes(host)) {
      errs.push(`config ${key} = ${conf[key]}: a pod must listen on all interfaces (0.0.0.0), or probes and scrapes cannot reach it`);
    }
  }
  const grpcPort = portOf(conf['grpc-address']);
  const metricsPort = portOf(conf['metrics-address']);
  const ports = Object.fromEntries((c.ports || []).map((p) => [p.name, p.containerPort]));
  if (ports.grpc !== grpcPort) errs.push(`containerPort grpc ${ports.grpc} != config grpc-address port ${grpcPort}`);
  if (ports.metrics !== metricsPort) errs.push(`containerPort metrics ${ports.metrics} != config metrics-address port ${metricsPort}`);

  // Probes on the gRPC port (grpc.health.v1): native gRPC probes, or, with TLS on (native
  // probes cannot speak TLS), `replayssm-cli health` run in the container with the pod's
  // certificate.
  const tls = Boolean(conf['tls-cert']);
  for (const probe of ['readinessProbe', 'livenessProbe', 'startupProbe']) {
    const p = c[probe];
    if (!p) { errs.push(`${probe} missing`); continue; }
    if (tls) {
      const cmd = (p.exec && p.exec.command) || [];
      if (cmd[0] !== 'replayssm-cli' || !cmd.includes('health')) {
        errs.push(`${probe} is not a replayssm-cli health exec probe (TLS is on: a native gRPC probe cannot speak it)`);
        continue;
      }
      const address = cmd[cmd.indexOf('--address') + 1] || '';
      if (portOf(address) !== grpcPort) errs.push(`${probe} port ${portOf(address)} != gRPC port ${grpcPort}`);
      for (const flag of ['--tls-ca', '--tls-cert', '--tls-key']) {
        const i = cmd.indexOf(flag);
        if (i < 0) errs.push(`${probe} lacks ${flag} (the server requires TLS)`);
        else if (conf['tls-client-ca'] && flag !== '--tls-ca' && cmd[i + 1] !== conf[flag.slice(2)]) {
          errs.push(`${probe} ${flag} ${cmd[i + 1]} is not the pod's own (${conf[flag.slice(2)]})`);
        }
      }
      continue;
    }
    if (!p.grpc) errs.push(`${probe} is not a native gRPC probe`);
    else if (p.grpc.port !== grpcPort) errs.push(`${probe} port ${p.grpc.port} != gRPC port ${grpcPort}`);
    if (p.grpc && p.grpc.service && p.grpc.service !== 'replayssm.v1.ReplaySSM') {
      errs.push(`${probe} asks health of unknown service ${p.grpc.service}`);
    }
  }

  // Key material comes from Secrets, never from the ConfigMap or the image.
  for (const key of ['tls-cert', 'tls-key', 'tls-client-ca', 'auth-tokens', 'peer-token']) {
    if (!conf[key]) continue;
    const m = (c.volumeMounts || []).find((x) => conf[key].startsWith(`${x.mountPath}/`));
    const v = m && (pod.spec.volumes || []).find((x) => x.name === m.name);
    if (!v || !v.secret) errs.push(`config ${key} = ${conf[key]} is not in a mounted Secret`);
  }

  // One GPU per pod, requests = limits for it; memory and CPU requested.
  const res = c.resources || {};
  const lim = res.limits || {};
  const req = res.requests || {};
  if (String(lim[GPU]) !== '1') errs.push(`limits.${GPU} is ${lim[GPU]}, expected 1`);
  if (req[GPU] !== undefined && String(req[GPU]) !== '1') errs.push(`requests.${GPU} is ${req[GPU]}, expected 1`);
  if (!req.cpu || !req.memory) errs.push('resources.requests must set cpu and memory');
  if (!lim.memory) errs.push('resources.limits must set memory');

  // Drain: preStop present, and the grace period covers preStop + the server's drain timeout +
  // the outgoing transfers it lets finish after it (each up to transfer-timeout).
  const preStop = c.lifecycle && c.lifecycle.preStop;
  if (!preStop) errs.push('lifecycle.preStop missing');
  let preStopSeconds = 0;
  if (preStop && preStop.exec) {
    const cmd = preStop.exec.command || [];
    if (cmd[0] === 'sleep') preStopSeconds = Number(cmd[1]) || 0;
  } else if (preStop && preStop.sleep) {
    preStopSeconds = preStop.sleep.seconds;
  }
  const drain = Number(conf['drain-timeout'] || 30);
  const transfer = Number(conf['transfer-timeout'] || 30);
  const grace = pod.spec.terminationGracePeriodSeconds ?? 30;
  if (grace <= preStopSeconds + drain + transfer) {
    errs.push(`terminationGracePeriodSeconds ${grace} <= preStop ${preStopSeconds} s + drain-timeout ${drain} s + transfer-timeout ${transfer} s`);
  }
  // A drain past its bound (drain + transfer + 1 s, DrainBound in service/server.h) is stuck:
  // the server says so (replayssm_drain_overdue), and a scrape must fall between that and the
  // kubelet's SIGKILL, or ReplaySSMDrainStuck can never fire.
  const mon = (monitors[0] || { spec: {} }).spec;
  const ep = (mon.podMetricsEndpoints || mon.endpoints || [])[0] || {};
  const every = /^(\d+)(s|m)$/.exec(String(ep.interval || '30s')) || [null, 'NaN', 's'];
  const scrape = Number(every[1]) * (every[2] === 'm' ? 60 : 1);
  if (!(scrape > 0)) errs.push(`the monitor's scrape interval ${ep.interval} is not like 15s or 1m`);
  const overdue = preStopSeconds + drain + transfer + 1;
  if (grace < overdue + scrape) {
    errs.push(`terminationGracePeriodSeconds ${grace} < preStop ${preStopSeconds} s + drain-timeout ${drain} s + transfer-timeout ${transfer} s + 1 s + a scrape (${scrape} s): no scrape sees a stuck drain (ReplaySSMDrainStuck)`);
  }
  const live = c.livenessProbe || {};
  const liveBudget = (live.periodSeconds || 10) * (live.failureThreshold || 3);
  if (liveBudget <= grace) {
    errs.push(`livenessProbe gives up after ${liveBudget} s, inside a drain (${grace} s): it would kill draining pods`);
  }
  const sc = { ...(pod.spec.securityContext || {}), ...(c.securityContext || {}) };
  if (!sc.runAsNonRoot) errs.push('securityContext.runAsNonRoot must be true');

  // Service: selects the pods, exposes grpc and metrics on the named ports.
  if (!matches({ matchLabels: svc.spec.selector }, podLabels)) errs.push('Service selector does not match the pod labels');
  for (const name of ['grpc', 'metrics']) {
    const sp = (svc.spec.ports || []).find((p) => p.name === name);
    if (!sp) { errs.push(`Service lacks port ${name}`); continue; }
    const target = typeof sp.targetPort === 'string' ? ports[sp.targetPort] : sp.targetPort;
    if (target !== ports[name]) errs.push(`Service port ${name} targets ${sp.targetPort}, not container port ${ports[name]}`);
  }

  // PDB and monitors select the pods; the monitor scrapes the metrics port.
  if (!matches(pdb.spec.selector, podLabels)) errs.push('PodDisruptionBudget selector does not match the pod labels');
  if (pdb.spec.minAvailable === undefined && pdb.spec.maxUnavailable === undefined) {
    errs.push('PodDisruptionBudget sets neither minAvailable nor maxUnavailable');
  }
  for (const m of monitors) {
    if (m.kind === 'PodMonitor') {
      if (!matches(m.spec.selector, podLabels)) errs.push('PodMonitor selector does not match the pod labels');
      const ep = (m.spec.podMetricsEndpoints || [])[0] || {};
      if (ep.port !== 'metrics') errs.push(`PodMonitor scrapes port ${ep.port}, not "metrics"`);
      if (m.spec.jobLabel && podLabels[m.spec.jobLabel] !== 'replayssm') {
        errs.push(`PodMonitor jobLabel ${m.spec.jobLabel} does not give job="replayssm" (the alerts match on it)`);
      }
    } else {
      if (!matches(m.spec.selector, svc.metadata.labels)) errs.push('ServiceMonitor selector does not match the Service');
      const ep = (m.spec.endpoints || [])[0] || {};
      if (ep.port !== 'metrics') errs.push(`ServiceMonitor scrapes port ${ep.port}, not "metrics"`);
    }
  }

  // PrometheusRule carries exactly the groups of deploy/prometheus/alerts.yml.
  if (JSON.stringify(rule.spec.groups) !== JSON.stringify(alertsDoc.groups)) {
    errs.push('PrometheusRule groups differ from deploy/prometheus/alerts.yml (regenerate: node validate.js gen-rule)');
  }
  return errs;
}

function checkKustomization(manifestFiles) {
  const file = path.join(DEPLOY, 'k8s', 'kustomization.yaml');
  if (!fs.existsSync(file)) return ['deploy/k8s/kustomization.yaml missing'];
  const k = yaml.load(fs.readFileSync(file, 'utf8'));
  const listed = new Set(k.resources || []);
  const errs = [];
  for (const f of manifestFiles) if (!listed.has(f)) errs.push(`kustomization.yaml does not list ${f}`);
  for (const f of listed) if (!manifestFiles.includes(f)) errs.push(`kustomization.yaml lists missing ${f}`);
  return errs;
}

function k8sErrors(manifests, alertsDoc) {
  const errs = [];
  for (const { file, doc } of manifests) {
    for (const e of schemaErrors(doc)) errs.push(`${file} (${doc.kind}): ${e}`);
  }
  return errs.concat(checkService(manifests, alertsDoc));
}

// ---------------------------------------------------------------------------------------------
// Metric names: the server's (string literals of service/*.cc: metrics.cc, transfer_service.cc).

function knownMetrics() {
  const dir = path.join(ROOT, 'service');
  const src = fs.readdirSync(dir).filter((f) => f.endsWith('.cc') && !f.endsWith('_test.cc'))
      .map((f) => fs.readFileSync(path.join(dir, f), 'utf8')).join('\n');
  const names = new Set(['up', 'scrape_duration_seconds']);
  for (const base of [...src.matchAll(/"(replayssm_[a-z0-9_]+)"/g)].map((m) => m[1])) {
    for (const suffix of ['', '_bucket', '_sum', '_count']) names.add(base + suffix);
  }
  return names;
}

function metricsIn(expr) {
  const stripped = expr.replace(/"(?:[^"\\]|\\.)*"/g, '""').replace(/\{[^}]*\}/g, '{}')
      .replace(/\[[^\]]*\]/g, '[]').replace(/\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)/g, '');
  return [...stripped.matchAll(/[a-zA-Z_:][a-zA-Z0-9_:]*/g)].map((m) => m[0])
      .filter((w) => !PROMQL_WORDS.has(w) && !/^\d/.test(w) && !/^(e|Inf|NaN|inf|nan)$/.test(w))
      .filter((w) => !/^\$/.test(w));
}

// ---------------------------------------------------------------------------------------------
// Grafana dashboard

function grafanaErrors(text, known) {
  let dash;
  try {
    dash = JSON.parse(text);
  } catch (e) {
    return [`not valid JSON: ${e.message}`];
  }
  const errs = [];
  if (!dash.title || !dash.uid) errs.push('dashboard needs a title and a uid');
  if (!Array.isArray(dash.panels) || dash.panels.length === 0) return errs.concat('dashboard has no panels');
  const ids = new Set();
  const flat = dash.panels.flatMap((p) => (p.type === 'row' ? (p.panels || []) : [p]));
  const used = new Set();
  for (const p of flat) {
    const where = `panel ${p.id} "${p.title}"`;
    if (ids.has(p.id)) errs.push(`${where}: duplicate id`);
    ids.add(p.id);
    if (!p.gridPos) errs.push(`${where}: no gridPos`);
    if (!Array.isArray(p.targets) || p.targets.length === 0) { errs.push(`${where}: no queries`); continue; }
    for (const t of p.targets) {
      if (!t.expr) { errs.push(`${where}: target without expr`); continue; }
      const names = metricsIn(t.expr);
      if (names.length === 0) errs.push(`${where}: "${t.expr}" names no metric`);
      for (const n of names) {
        used.add(n.replace(/_(bucket|sum|count)$/, ''));
        if (!known.has(n)) errs.push(`${where}: unknown metric ${n} in "${t.expr}"`);
      }
    }
  }
  // The metrics an operator needs most must be on the dashboard.
  for (const must of ['replayssm_rpcs_total', 'replayssm_forward_duration_seconds', 'replayssm_slots',
    'replayssm_snapshot_evictions_total', 'replayssm_invariant_refusals_total', 'replayssm_transfer_failures_total']) {
    if (!used.has(must)) errs.push(`no panel shows ${must}`);
  }
  return errs;
}

// ---------------------------------------------------------------------------------------------
// Alerts: tests, runbooks, metric names.

function alertErrors(alertsDoc, testsDoc, opsText, known) {
  const errs = [];
  const alerts = alertsDoc.groups.flatMap((g) => g.rules).filter((r) => r.alert);
  const firing = new Set();
  const quiet = new Set();
  for (const t of testsDoc.tests || []) {
    for (const a of t.alert_rule_test || []) {
      ((a.exp_alerts || []).length ? firing : quiet).add(a.alertname);
    }
  }
  for (const r of alerts) {
    if (!firing.has(r.alert)) errs.push(`${r.alert}: no promtool test where it fires`);
    if (!quiet.has(r.alert)) errs.push(`${r.alert}: no promtool test where it stays quiet`);
    const anchor = r.alert.toLowerCase();
    if (!r.annotations || r.annotations.runbook !== `docs/operations.md#${anchor}`) {
      errs.push(`${r.alert}: annotations.runbook must be docs/operations.md#${anchor}`);
    }
    if (!new RegExp(`^### ${r.alert}\\b`, 'm').test(opsText)) errs.push(`${r.alert}: no "### ${r.alert}" section in docs/operations.md`);
    if (!r.labels || !['critical', 'warning', 'info'].includes(r.labels.severity)) errs.push(`${r.alert}: labels.severity must be critical|warning|info`);
    for (const n of metricsIn(r.expr)) if (!known.has(n)) errs.push(`${r.alert}: unknown metric ${n}`);
  }
  for (const want of ['ReplaySSMDown', 'ReplaySSMHighErrorRatio', 'ReplaySSMForwardLatencyHigh',
    'ReplaySSMSlotPoolNearFull', 'ReplaySSMSnapshotEvictionsHigh', 'ReplaySSMTransferFailures',
    'ReplaySSMInvariantRefusals']) {
    if (!alerts.some((r) => r.alert === want)) errs.push(`required alert ${want} missing`);
  }
  return errs;
}

// ---------------------------------------------------------------------------------------------
// Dockerfile must-haves (dockerfilelint does the generic lint).

function dockerfileErrors(text) {
  const errs = [];
  const lines = text.replace(/\\\n/g, ' ').split('\n').map((l) => l.trim()).filter((l) => l && !l.startsWith('#'));
  const froms = lines.filter((l) => /^FROM\s/i.test(l));
  if (froms.length < 2) errs.push('not multi-stage (needs a build and a runtime stage)');
  if (froms[0] && !/nvidia\/cuda:.*-devel-/.test(froms[0])) errs.push('build stage must start FROM an nvidia/cuda *-devel-* image');
  const last = froms[froms.length - 1] || '';
  if (!/nvidia\/cuda:.*-runtime-/.test(last)) errs.push('final stage must be FROM an nvidia/cuda *-runtime-* image');
  const lastIdx = lines.lastIndexOf(last);
  const final = lines.slice(lastIdx);
  const users = final.filter((l) => /^USER\s/i.test(l));
  if (users.length === 0) errs.push('final stage has no USER (runs as root)');
  else if (/^USER\s+(root|0)(\W|$)/i.test(users[users.length - 1])) errs.push('final USER is root');
  if (!final.some((l) => /^HEALTHCHECK\s+.*CMD\s+.*health/i.test(l))) errs.push('no HEALTHCHECK running a grpc.health.v1 probe');
  if (!final.some((l) => /^ENTRYPOINT\s+.*docker-entrypoint\.sh/.test(l))) errs.push('ENTRYPOINT must be deploy/docker-entrypoint.sh');
  if (!final.some((l) => /^EXPOSE\s+.*\b50051\b.*\b9400\b/.test(l))) errs.push('EXPOSE must list 50051 and 9400');
  // UCX's RDMA transports find no device without the NIC's verbs provider (libibverbs loads it).
  if (!final.some((l) => /^RUN\s+.*apt-get install\b.*\bibverbs-providers\b/.test(l))) errs.push('the final stage must install ibverbs-providers (UCX RDMA finds no NIC without it)');
  if (!final.some((l) => /^COPY\s+.*replayssm\.conf/.test(l))) errs.push('the config file is not copied into the image');
  if (!lines.some((l) => /^RUN\s+.*deploy\/build-image-steps\.sh/.test(l))) errs.push('the build stage must run deploy/build-image-steps.sh (the steps CI runs)');
  if (!lines.some((l) => /^RUN\s+.*scripts\/install-deps\.sh/.test(l))) errs.push('the build stage must install packages with scripts/install-deps.sh');
  if (froms.some((f) => /:latest\b/.test(f) || !/:/.test(f.split(/\s+/)[1]))) errs.push('base images must be pinned to a tag');
  return errs;
}

// ---------------------------------------------------------------------------------------------
// Self test: one fault at a time must be reported.

function selftest(ctx) {
  const faults = [];
  const k8s = (name, mutate, expect) => faults.push({ name, expect, run: () => {
    const ms = clone(ctx.manifests);
    mutate((kind) => ms.find((m) => m.doc.kind === kind).doc);
    return k8sErrors(ms, ctx.alertsDoc);
  } });
  const ctr = (get) => get('Deployment').spec.template.spec.containers[0];
  k8s('httpGet readiness probe', (g) => { ctr(g).readinessProbe = { httpGet: { port: 9400, path: '/' } }; }, /readinessProbe is not a (native gRPC|replayssm-cli health exec) probe/);
  k8s('liveness probe on the metrics port', (g) => {
    const p = ctr(g).livenessProbe;
    if (p.grpc) p.grpc.port = 9400;
    else p.exec.command[p.exec.command.indexOf('--address') + 1] = 'localhost:9400';
  }, /livenessProbe port 9400/);
  k8s('native gRPC probe on a TLS port', (g) => { ctr(g).startupProbe = { grpc: { port: 50051 } }; }, /startupProbe is not a replayssm-cli health exec probe/);
  k8s('token file not from a Secret', (g) => {
    const v = g('Deployment').spec.template.spec.volumes.find((x) => x.secret && x.secret.secretName === 'replayssm-auth');
    delete v.secret; v.emptyDir = {};
  }, /auth-tokens = .* is not in a mounted Secret/);
  k8s('two GPUs', (g) => { ctr(g).resources.limits[GPU] = 2; }, /limits.nvidia.com\/gpu is 2/);
  k8s('no GPU', (g) => { delete ctr(g).resources.limits[GPU]; }, /limits.nvidia.com\/gpu is undefined/);
  k8s('containerPort differs from config', (g) => { ctr(g).ports[0].containerPort = 50052; }, /containerPort grpc 50052/);
  k8s('config listens on loopback', (g) => { g('ConfigMap').data['replayssm.conf'] = g('ConfigMap').data['replayssm.conf'].replace('0.0.0.0:50051', '127.0.0.1:50051'); }, /must listen on all interfaces/);
  k8s('no preStop', (g) => { delete ctr(g).lifecycle; }, /preStop missing/);
  k8s('grace period shorter than drain', (g) => { g('Deployment').spec.template.spec.terminationGracePeriodSeconds = 20; }, /terminationGracePeriodSeconds 20/);
  k8s('PDB selector mismatch', (g) => { g('PodDisruptionBudget').spec.selector.matchLabels['app.kubernetes.io/name'] = 'other'; }, /PodDisruptionBudget selector/);
  k8s('PodMonitor selector mismatch', (g) => { g('PodMonitor').spec.selector.matchLabels = { app: 'x' }; }, /PodMonitor selector/);
  k8s('Service targets a wrong port', (g) => { g('Service').spec.ports[0].targetPort = 8080; }, /Service port grpc targets 8080/);
  k8s('misspelled field', (g) => { ctr(g).readinesProbe = ctr(g).readinessProbe; }, /unknown field .*readinesProbe/);
  k8s('misplaced field', (g) => { g('Deployment').spec.template.spec.containers[0].resources.limit = {}; }, /unknown field .*resources\/limit\b/);
  k8s('wrong type', (g) => { ctr(g).ports[1].containerPort = '9400'; }, /containerPort must be integer/);
  k8s('missing required field', (g) => { delete g('Deployment').spec.selector; }, /must have required property '?selector/);
  k8s('bad PodMonitor field type', (g) => { g('PodMonitor').spec.podMetricsEndpoints = 'metrics'; }, /podMetricsEndpoints must be array/);
  k8s('PrometheusRule drifted', (g) => { g('PrometheusRule').spec.groups[0].rules[0].for = '5m'; }, /PrometheusRule groups differ/);
  k8s('grace period that no scrape of a stuck drain fits in', (g) => { g('Deployment').spec.template.spec.terminationGracePeriodSeconds = 75; }, /terminationGracePeriodSeconds 75 < .*ReplaySSMDrainStuck/);
  k8s('liveness kills draining pods', (g) => { ctr(g).livenessProbe.failureThreshold = 2; }, /would kill draining pods/);

  const dash = JSON.parse(ctx.grafanaText);
  faults.push({ name: 'dashboard unknown metric', expect: /unknown metric replayssm_slot_used/, run: () => {
    const d = clone(dash); d.panels.find((p) => p.targets)[`targets`][0].expr = 'sum(replayssm_slot_used)'; return grafanaErrors(JSON.stringify(d), ctx.known);
  } });
  faults.push({ name: 'dashboard invalid JSON', expect: /not valid JSON/, run: () => grafanaErrors(ctx.grafanaText.slice(0, -3), ctx.known) });

  faults.push({ name: 'alert without a quiet test', expect: /ReplaySSMDown: no promtool test where it stays quiet/, run: () => {
    const t = clone(ctx.testsDoc);
    for (const x of t.tests) x.alert_rule_test = (x.alert_rule_test || []).filter((a) => a.alertname !== 'ReplaySSMDown' || (a.exp_alerts || []).length);
    return alertErrors(ctx.alertsDoc, t, ctx.opsText, ctx.known);
  } });
  faults.push({ name: 'alert on an unknown metric', expect: /unknown metric replayssm_slots_used/, run: () => {
    const a = clone(ctx.alertsDoc); a.groups[0].rules[3].expr = 'replayssm_slots_used > 0'; return alertErrors(a, ctx.testsDoc, ctx.opsText, ctx.known);
  } });
  faults.push({ name: 'alert without runbook section', expect: /no "### ReplaySSMDrainStuck" section/, run: () => alertErrors(ctx.alertsDoc, ctx.testsDoc, ctx.opsText.replace(/^### ReplaySSMDrainStuck/m, '### Drain'), ctx.known) });

  const df = (name, from, to, expect) => faults.push({ name, expect, run: () => {
    if (!ctx.dockerText.includes(from)) return [`selftest: "${from}" not in the Dockerfile`];
    return dockerfileErrors(ctx.dockerText.replace(from, to));
  } });
  df('Dockerfile runs as root', 'USER replayssm:replayssm', 'USER root', /final USER is root/);
  df('Dockerfile without HEALTHCHECK', 'HEALTHCHECK', '# HEALTHCHECK', /no HEALTHCHECK/);
  df('Dockerfile without the verbs providers', 'ibverbs-providers librdmacm1', 'librdmacm1', /ibverbs-providers/);
  df('Dockerfile single stage', 'FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION} AS runtime', '', /multi-stage|runtime-/);

  let failed = 0;
  for (const f of faults) {
    const errs = f.run();
    const hit = errs.some((e) => f.expect.test(e));
    console.log(`${hit ? 'ok  ' : 'MISS'} ${f.name}${hit ? '' : `: expected ${f.expect}, got ${JSON.stringify(errs)}`}`);
    if (!hit) failed++;
  }
  console.log(`selftest: ${faults.length - failed} of ${faults.length} faults detected`);
  return failed ? ['selftest: some faults went undetected'] : [];
}

// ---------------------------------------------------------------------------------------------

function context() {
  const read = (...p) => fs.readFileSync(path.join(ROOT, ...p), 'utf8');
  return {
    manifests: loadManifests(path.join(DEPLOY, 'k8s')),
    alertsDoc: yaml.load(read('deploy', 'prometheus', 'alerts.yml')),
    testsDoc: yaml.load(read('deploy', 'prometheus', 'tests', 'alerts_test.yml')),
    grafanaText: read('deploy', 'grafana', 'replayssm.json'),
    dockerText: read('deploy', 'Dockerfile'),
    opsText: read('docs', 'operations.md'),
    known: knownMetrics(),
  };
}

function main() {
  const cmd = process.argv[2];
  const ctx = context();
  let errs;
  switch (cmd) {
    case 'k8s': {
      errs = k8sErrors(ctx.manifests, ctx.alertsDoc);
      const files = [...new Set(ctx.manifests.map((m) => m.file))];
      errs = errs.concat(checkKustomization(files));
      console.log(`k8s: ${ctx.manifests.length} manifests in ${files.length} files: ${ctx.manifests.map((m) => m.doc.kind).join(', ')}`);
      break;
    }
    case 'grafana': errs = grafanaErrors(ctx.grafanaText, ctx.known); break;
    case 'alerts': errs = alertErrors(ctx.alertsDoc, ctx.testsDoc, ctx.opsText, ctx.known); break;
    case 'dockerfile': errs = dockerfileErrors(ctx.dockerText); break;
    case 'selftest': errs = selftest(ctx); break;
    case 'gen-rule': {
      // Writes deploy/k8s/prometheusrule.yaml from deploy/prometheus/alerts.yml.
      const header = '# Generated from deploy/prometheus/alerts.yml by `node deploy/tools/validate.js gen-rule`;\n' +
          '# edit alerts.yml and regenerate (ctest -R deploy.k8s fails while they differ).\n';
      const rule = { apiVersion: 'monitoring.coreos.com/v1', kind: 'PrometheusRule',
        metadata: { name: 'replayssm', labels: { 'app.kubernetes.io/name': 'replayssm', 'app.kubernetes.io/component': 'state-cache' } },
        spec: { groups: ctx.alertsDoc.groups } };
      fs.writeFileSync(path.join(DEPLOY, 'k8s', 'prometheusrule.yaml'), header + yaml.dump(rule, { lineWidth: 100 }));
      errs = [];
      break;
    }
    default:
      console.error('usage: node validate.js k8s|grafana|alerts|dockerfile|selftest|gen-rule');
      process.exit(2);
  }
  for (const e of errs) console.error(`FAIL ${cmd}: ${e}`);
  console.log(`${cmd}: ${errs.length === 0 ? 'OK' : `${errs.length} problem(s)`}`);
  process.exit(errs.length === 0 ? 0 : 1);
}

if (require.main === module) main();
module.exports = { k8sErrors, grafanaErrors, alertErrors, dockerfileErrors, metricsIn, parseConf };
