#!/usr/bin/env bash
# promtool checks of deploy/prometheus, each also shown to fail on a broken copy:
#   config  promtool check config prometheus.yml (+ the rule files it names)
#   rules   promtool check rules alerts.yml
#   test    promtool test rules tests/alerts_test.yml (firing and not-firing cases per alert)
# usage: promtool_checks.sh config|rules|test [PROMTOOL]
set -euo pipefail
what=$1
promtool=${2:-promtool}
dir=$(cd "$(dirname "$0")/../prometheus" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cp -r "$dir"/. "$tmp/"

must_fail() {  # NAME CMD...: the broken copy must be rejected
  local name=$1; shift
  if "$@" >"$tmp/out" 2>&1; then
    echo "promtool_checks: FAIL: $name was accepted:"; cat "$tmp/out"; exit 1
  fi
  echo "promtool_checks: ok: rejects $name"
}

case "$what" in
  config)
    "$promtool" check config "$dir/prometheus.yml"
    sed -i 's/scrape_interval: 15s/scrape_interval: 15 seconds/' "$tmp/prometheus.yml"
    must_fail "a bad scrape_interval" "$promtool" check config "$tmp/prometheus.yml"
    cp "$dir/prometheus.yml" "$tmp/prometheus.yml"
    sed -i 's/rate(replayssm_forward_duration_seconds_bucket\[5m\])/rate(replayssm_forward_duration_seconds_bucket)/' "$tmp/alerts.yml"
    must_fail "a referenced rule file with a bad expression" "$promtool" check config "$tmp/prometheus.yml"
    ;;
  rules)
    "$promtool" check rules "$dir/alerts.yml"
    sed -i '0,/for: 3m/s//for: three minutes/' "$tmp/alerts.yml"
    must_fail "a bad 'for' duration" "$promtool" check rules "$tmp/alerts.yml"
    cp "$dir/alerts.yml" "$tmp/alerts.yml"
    sed -i '0,/- alert: ReplaySSMHighErrorRatio/s//- alert: ReplaySSMDown/' "$tmp/alerts.yml"
    sed -i '0,/  - name: replayssm/s//  - name: replayssm\n    rules: []\n  - name: replayssm/' "$tmp/alerts.yml"
    must_fail "a duplicate group name" "$promtool" check rules "$tmp/alerts.yml"
    ;;
  test)
    (cd "$dir/tests" && "$promtool" test rules alerts_test.yml)
    # Each alert's unit tests must notice a changed threshold or duration.
    for change in '/HighErrorRatio/,/for:/ s/) > 0.05/) > 0.5/' \
                  '/ForwardLatencyHigh/,/for:/ s/) > 0.05/) > 0.5/' \
                  '/SlotPoolNearFull/,/for:/ s/> 0.9$/> 0.99/' \
                  '/SnapshotEvictionsHigh/,/for:/ s/> 10$/> 100/' \
                  '/TransferFailures/,/labels:/ s/>= 3$/>= 30/' \
                  '/InvariantRefusals/,/labels:/ s/> 0$/> 5/' \
                  '/ReplaySSMDown/,/for:/ s/== 0$/== 2/' \
                  '/alert: ReplaySSMDrainStuck/,/labels:/ s/\[5m\]/[1m]/' \
                  '/TransferBufferStalls/,/labels:/ s/) > 0$/) > 1/' \
                  '/RegionUnmapStalls/,/labels:/ s/) > 0$/) > 1/'; do
      cp "$dir/alerts.yml" "$tmp/alerts.yml"
      sed -i "$change" "$tmp/alerts.yml"
      if cmp -s "$dir/alerts.yml" "$tmp/alerts.yml"; then
        echo "promtool_checks: FAIL: mutation '$change' changed nothing in alerts.yml"; exit 1
      fi
      must_fail "alerts.yml mutated by '$change'" bash -c "cd '$tmp/tests' && '$promtool' test rules alerts_test.yml"
    done
    ;;
  *) echo "usage: $0 config|rules|test [PROMTOOL]" >&2; exit 2 ;;
esac
echo "promtool_checks: $what OK"
