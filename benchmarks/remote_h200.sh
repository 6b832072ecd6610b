#!/usr/bin/env bash
# Issue 18 section 4 on a quiet many-core machine (the H200 host: no moto, no internet).
#
# Runs benchmarks/staging.py and benchmarks/ckpt_remote.py: each starts its own moto S3 server
# (python -m moto.server, one process) and the shaping proxy (benchmarks/_shaping_proxy.py), and
# measures straight to the server and through the proxy (RTT_MS, MBPS per connection) with the
# sequential fs.get / fs.put loop in the same run; both print their ratios. If moto or s3fs is
# not importable, the wheel bundle in .devicewheels-remote/ is installed into /tmp/site-remote
# first (and the usual .devicewheels/ bundle if crc32c is missing). The bundle (Python 3.12; the
# pins keep botocore inside aiobotocore's range and python-dateutil below 3):
#   DW_DIR=.devicewheels-remote ../shared/tools/device-wheels moto werkzeug flask flask-cors \
#     xmltodict responses jinja2 markupsafe itsdangerous blinker click boto3==1.43.117 \
#     botocore==1.43.117 s3transfer jmespath aiobotocore==3.10.0 aiohttp aiohappyeyeballs \
#     aioitertools s3fs==2026.9.0 fsspec==2026.9.0 multidict yarl frozenlist aiosignal propcache \
#     attrs wrapt python-dateutil==2.9.0.post0 typing_extensions pyyaml cryptography cffi \
#     pycparser requests urllib3 idna charset-normalizer certifi six pytz py-partiql-parser Output: stdout, and under $OUT (when set) remote_h200.txt and the rewritten
# docs/benchmarks.md (sections `staging` and `ckpt_remote`).
#
#   bash benchmarks/remote_h200.sh                 # full sizes (a few minutes on 16 cores)
#   QUICK=1 bash benchmarks/remote_h200.sh         # small sizes, docs untouched: checks the script
#   ONLY=ckpt bash benchmarks/remote_h200.sh       # one of the two (ONLY=staging, ONLY=ckpt)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
RTT_MS=${RTT_MS:-20}
MBPS=${MBPS:-50}
if ! "$PY" -c "import moto.server, s3fs, boto3" 2>/dev/null; then
  [ -d .devicewheels-remote ] || { echo "no moto/s3fs and no .devicewheels-remote/ bundle" >&2; exit 2; }
  rm -rf /tmp/dw-remote && mkdir -p /tmp/dw-remote
  cat .devicewheels-remote/part-* | tar x -C /tmp/dw-remote
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-remote /tmp/dw-remote/*.whl
  export PYTHONPATH="/tmp/site-remote${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PY" -c "import crc32c" 2>/dev/null && [ -d .devicewheels ]; then  # the lead's usual bundle
  rm -rf /tmp/dw-main && mkdir -p /tmp/dw-main
  cat .devicewheels/part-* | tar x -C /tmp/dw-main
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-main /tmp/dw-main/*.whl
  export PYTHONPATH="/tmp/site-main${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export AWS_ACCESS_KEY_ID=bench AWS_SECRET_ACCESS_KEY=bench AWS_DEFAULT_REGION=us-east-1
"$PY" -c "import moto, s3fs, aiobotocore; print('moto', moto.__version__, '| s3fs', s3fs.__version__, '| aiobotocore', aiobotocore.__version__)"
echo "cores: $(nproc)"
if [ -n "${QUICK:-}" ]; then
  stage_args=(--shards 4 --shard-mb 2 --repeat 1 --workers 16 --no-write)
  ckpt_args=(--size-mb 24 --repeats 1 --no-write)
else
  stage_args=(--shards 48 --shard-mb 8 --repeat 2 --workers 16)
  ckpt_args=(--size-mb 256 --repeats 3)
fi
log=$(mktemp)
status=0
if [ "${ONLY:-staging}" = staging ] || [ -z "${ONLY:-}" ]; then
  "$PY" benchmarks/staging.py "${stage_args[@]}" --rtt-ms "$RTT_MS" --mbps "$MBPS" 2>&1 | tee -a "$log" || status=1
fi
if [ "${ONLY:-ckpt}" = ckpt ] || [ -z "${ONLY:-}" ]; then
  "$PY" benchmarks/ckpt_remote.py "${ckpt_args[@]}" --rtt-ms "$RTT_MS" --mbps "$MBPS" 2>&1 | tee -a "$log" || status=1
fi
echo
echo "== ratios (through the proxy: target >= 5x) =="
grep -E "^Target" "$log" || true
if [ -n "${OUT:-}" ]; then
  cp "$log" "$OUT/remote_h200.txt" && chmod 644 "$OUT/remote_h200.txt"
  cp docs/benchmarks.md "$OUT/benchmarks.md"
fi
rm -f "$log"
exit $status
