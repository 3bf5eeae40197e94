#!/usr/bin/env bash
# bash tools/device/watch.sh SECONDS: wait up to SECONDS (or until the plan is done),
# then report every step's state and pack /opt/bylogs into $OUT/logs.tgz.
n=${1:-500} logs=${PLAN_LOGS:-/opt/bylogs} every=${WATCH_PACK_S:-60} t0=$(date +%s)
[ -f $logs/plan.sh ] && for _ in 1 2 3 4 5 6; do [ -f $logs/progress.txt ] && break; sleep 2; done
if [ ! -f $logs/progress.txt ]; then echo "NO PROGRESS FILE: a fresh machine, the plan is gone"; exit 3; fi
# the logs are packed every minute (WATCH_PACK_S) as well, so a call cut short still brings them back
pack() { tar -czf "$OUT/logs.tgz.part" -C $logs . 2>/dev/null && mv -f "$OUT/logs.tgz.part" "$OUT/logs.tgz"; }
last=$t0
while [ $(( $(date +%s) - t0 )) -lt "$n" ] && [ ! -f $logs/plan.done ]; do
  sleep 5
  if [ $(( $(date +%s) - last )) -ge "$every" ]; then pack; last=$(date +%s); fi
done
cat $logs/progress.txt
for f in $logs/*.log; do
  [ -f "$f" ] || continue
  name=$(basename "$f" .log)
  echo "== $name rc=$(cat $logs/$name.rc 2>/dev/null || echo running)"
  grep -E "FAILED|ERROR|Timeout|Traceback|[0-9]+ (passed|failed)|^\| [a-z]|-> (PASS|FAIL)" "$f" | tail -8 | cut -c1-400
  tail -c 200 "$f"; echo
done
pack; date -u
