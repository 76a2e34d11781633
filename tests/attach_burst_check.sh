#!/bin/sh
# bench/attach_burst end to end, as scripts/gpu-check runs it on a GPU
# machine: a daemon holding a tiny model, one round of one engine alone and
# 64 at once (each must be served by the daemon, or attach_burst fails), and
# every line the check's table reads.
#   attach_burst_check.sh WEIGHTD ATTACH_BURST ATTACH_PROBE
set -eu
weightd=$1 burst=$2 probe=$3
work=$(mktemp -d)
pid=""
cleanup() {
  if [ -n "$pid" ]; then
    kill "$pid" 2>/dev/null || :
    wait "$pid" 2>/dev/null || :
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
mkdir -m 700 "$work/sock"
export WEIGHTD_CACHE_DIR="$work/cache"
"$weightd" make-checkpoint --preset tiny "$work/model" >/dev/null
"$weightd" serve --socket-dir "$work/sock" >"$work/serve.out" 2>"$work/serve.err" &
pid=$!
i=0
until grep -q ready "$work/serve.out"; do
  i=$((i + 1))
  if [ "$i" -gt 300 ]; then cat "$work/serve.err"; exit 1; fi
  sleep 0.1
done
"$weightd" preload "$work/model" --socket-dir "$work/sock" >/dev/null
if ! "$burst" "$probe" "$work/model" "$work/sock" "$pid" 1 >"$work/out.txt"; then
  cat "$work/out.txt"
  echo "attach_burst failed"
  exit 1
fi
cat "$work/out.txt"
for key in attach_cores attach_rounds attach_alone_ms attach_p50_ms attach_p99_ms \
           attach_p99_since_release_ms attach_round_cpu_ms attach_share_ms attach_cores_for_5x; do
  grep -q "^$key: [0-9]" "$work/out.txt" || { echo "no $key"; exit 1; }
done
grep -q '^attach_engines: 64$' "$work/out.txt"
# 64 engines' attaches take some CPU time; a zero would be a parse gone wrong.
awk '/^attach_round_engines_cpu_ms:/ { found = 1; ok = $2 > 0 } END { exit !(found && ok) }' \
  "$work/out.txt" || { echo "no engine CPU time counted"; exit 1; }
# Usage errors are said, not crashes.
if "$burst" "$probe" 2>/dev/null; then echo "a missing argument was not refused"; exit 1; fi
if "$burst" "$probe" "$work/model" "$work/sock" "$pid" 10abc 2>/dev/null; then
  echo "ROUNDS 10abc was not refused"; exit 1
fi
