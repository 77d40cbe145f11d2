#!/bin/bash
# Interleaved runs of the steady scenario at 1,000/s with stage timing (see sitecustomize.py).
# usage: run.sh OUTDIR LABEL:REPORT_SLICE:SEND_NOW_SLICE:LINGER_MS ...  (empty fields: as shipped)
# ROUNDS="1 2" by default; OUTBOX_TRACE_LOOP=1 in the environment also times the loop's calls.
set -u
out=$1; shift
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../../.."
for round in ${ROUNDS:-1 2}; do
  for v in "$@"; do
    IFS=: read -r label slice sendnow linger <<< "$v"
    d=$out/$label-$round; rm -rf "$d"; mkdir -p "$d"
    env OUTBOX_TRACE="$d" ${slice:+OUTBOX_EXP_SLICE=$slice} ${sendnow:+OUTBOX_EXP_SENDNOW=$sendnow} \
      ${linger:+OUTBOX_EXP_LINGER=$linger} PYTHONPATH="$here" \
      .venv/bin/python -m outbox bench --scenarios steady --dsn 'host=127.0.0.1 dbname=test user=root' \
      --rates 1000 --steady-seconds 20 --out "$d/out" > "$d/log" 2>&1
    echo "$label-$round $(date +%T) $(grep -E '^\| 1,000/s' "$d/out/results.md" | awk -F'|' '{print $3 "=" $5}' | tr '\n' ' ')"
    .venv/bin/python "$here/stages.py" "$d" ${OUTBOX_TRACE_LOOP:+loop}
  done
done
