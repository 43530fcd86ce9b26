#!/usr/bin/env bash
# HTTP-level overhead of tollgate, against a bare axum route, a no-op layer
# and tower_governor, measured two ways on the `http_hello` bench server.
#
# Usage:
#   benches/http_instructions.sh [N]         instruction counts (the gate)
#   benches/http_instructions.sh ab [PAIRS]  paired wall-clock A/B, bare vs tollgate
#   benches/http_instructions.sh -h          this text
#
# Instruction mode (default N=20000): for each variant (bare, noop, floor,
# tollgate, governor) the server runs twice under `valgrind
# --tool=callgrind`: an idle run (`--requests 0`: start, become ready, then
# stay up as long as the loaded run served, so background work driven by
# wall time, such as the coarse clock's ticker, cancels out) and a loaded
# run that serves N keep-alive requests from `wrk -c 4 -t 1` on loopback and
# then shuts down gracefully. Instructions per request are
# (loaded total Ir - idle total Ir) / requests served, and the table gives
# each variant's ratio to bare, tollgate - noop, and the floor lines: what
# the HTTP side of tollgate's surface costs with no accounting at all (find
# the key header, a record in the request's extensions, a request-id
# response header) and what tollgate adds on top. Every response must be
# 2xx, or the script fails. The N-th request starts the graceful shutdown;
# requests already read on the keep-alive connections are still served (a
# handful more), so the server reports what its handler served and that
# count is the divisor.
# Callgrind output is kept in $OUT (default $CARGO_TARGET_DIR/http_instructions)
# for `callgrind_annotate --inclusive=yes`.
#
# A/B mode (default 20 pairs): bare and tollgate servers run natively, one
# at a time, alternating which goes first; each gets `wrk -c 4 -t 1` for
# AB_SECONDS (default 3). Prints each pair's req/s and ratio and the median
# ratio tollgate/bare (sanity bound >= 0.95). Noisy on shared machines.
#
# Every variant receives the same request, `GET /` with an `x-api-key`
# header (tollgate's real key; a same-length dummy for the others), so the
# differences are the layers' own work; SAME_REQUEST=0 sends the header to
# tollgate only.
#
# Environment: REQUESTS (same as N), VARIANTS (default "bare noop floor
# tollgate governor"), CONNECTIONS (default 4), OUT, AB_SECONDS,
# CARGO_TARGET_DIR (default <repo>/target), SAME_REQUEST (default 1),
# CLOCK (tollgate's clock: coarse, the default and what the examples run,
# or system), HOLD_IDLE (default 1; 0 ends idle runs at once).
#
# Needs valgrind (with callgrind) and wrk: `apt-get install -y valgrind wrk`.
# Runs from any directory.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
CONNECTIONS="${CONNECTIONS:-4}"
CLOCK="${CLOCK:-coarse}"
HOLD_IDLE="${HOLD_IDLE:-1}"
OUT="${OUT:-$CARGO_TARGET_DIR/http_instructions}"

MODE=instructions
case "${1:-}" in
    -h | --help) usage; exit 0 ;;
    ab)
        MODE=ab
        PAIRS="${2:-20}"
        case "$PAIRS" in '' | *[!0-9]* | 0) usage >&2; exit 2 ;; esac
        ;;
    '') REQUESTS="${REQUESTS:-20000}" ;;
    *[!0-9]*) usage >&2; exit 2 ;;
    *) REQUESTS="$1" ;;
esac

die() { echo "error: $*" >&2; exit 1; }
need() {
    command -v "$1" >/dev/null 2>&1 ||
        die "$1 is not installed; install it with: apt-get install -y $2"
}
need wrk wrk
if [ "$MODE" = instructions ]; then
    need valgrind valgrind
    need callgrind_annotate valgrind
    [ "$REQUESTS" -gt 0 ] || die "N must be positive"
fi

mkdir -p "$OUT"

# Build once (the bench profile: release with debug = 1) and find the binary.
echo "==> building the http_hello bench (cargo bench --no-run)" >&2
BIN="$(cd "$ROOT" && cargo bench --no-run --bench http_hello --message-format=json |
    jq -r 'select(.reason == "compiler-artifact" and .target.name == "http_hello")
           | .executable // empty' | tail -n 1)"
[ -x "$BIN" ] || die "could not find the http_hello bench executable"
echo "    $BIN" >&2

SERVER_PID=""
WRK_PID=""
cleanup() {
    [ -n "$WRK_PID" ] && kill "$WRK_PID" 2>/dev/null || true
    [ -n "$SERVER_PID" ] && kill "$SERVER_PID" 2>/dev/null || true
}
trap cleanup EXIT

# start_server STDOUT_FILE CMD... : starts the server in the background, waits
# for its address line, and sets SERVER_PID, ADDR and HEADER (the tollgate
# key header, or nothing).
start_server() {
    local stdout="$1"
    shift
    : >"$stdout"
    "$@" >"$stdout" 2>"$stdout.stderr" &
    SERVER_PID=$!
    local waited=0
    until grep -q '^[0-9.]*:[0-9]*$' "$stdout"; do
        kill -0 "$SERVER_PID" 2>/dev/null ||
            die "server exited before listening; see $stdout.stderr"
        [ "$waited" -lt 6000 ] || die "server did not listen within 600 s"
        sleep 0.1
        waited=$((waited + 1))
    done
    ADDR="$(grep -m1 '^[0-9.]*:[0-9]*$' "$stdout")"
    # The key line follows the address line at once for the tollgate variant.
    sleep 0.2
    HEADER=()
    local key
    key="$(sed -n 's/^key=//p' "$stdout")"
    # Every variant gets the same request: the other variants a key of the
    # same shape that nothing reads, so parsing it is not billed to tollgate.
    [ -n "$key" ] || [ "${SAME_REQUEST:-1}" != 1 ] || key="$DUMMY_KEY"
    if [ -n "$key" ]; then HEADER=(-H "x-api-key: $key"); fi
}
DUMMY_KEY="tg_$(printf '0%.0s' $(seq 48))"

# non_2xx WRK_OUTPUT: responses outside 2xx/3xx reported by wrk (0 if none).
non_2xx() { sed -n 's/.*Non-2xx or 3xx responses: *\([0-9]*\).*/\1/p' "$1" | grep . || echo 0; }

# total_ir CALLGRIND_OUT: the run's total instruction count.
total_ir() { awk '/^(summary|totals):/ { print $2; exit }' "$1"; }

instructions() {
    local variants="${VARIANTS:-bare noop floor tollgate governor}"
    declare -A PER_REQ
    printf '%-9s %15s %15s %8s %12s\n' variant "loaded Ir" "idle Ir" served "Ir/request" \
        >"$OUT/table.txt.tmp"
    for variant in $variants; do
        local base="$OUT/$variant"
        echo "==> $variant: loaded run, $REQUESTS requests, under callgrind" >&2
        local started
        started="$(date +%s%N)"
        start_server "$base.loaded.stdout" valgrind --tool=callgrind \
            --callgrind-out-file="$base.loaded.callgrind" \
            "$BIN" --variant "$variant" --requests "$REQUESTS" --clock "$CLOCK"
        local serving
        serving="$(date +%s%N)"
        wrk -c "$CONNECTIONS" -t 1 -d 3600s --timeout 60s "${HEADER[@]}" \
            "http://$ADDR/" >"$base.wrk" 2>&1 &
        WRK_PID=$!
        local rc=0
        wait "$SERVER_PID" || rc=$?
        local held_ms=$((($(date +%s%N) - serving) / 1000000))
        SERVER_PID=""
        kill -INT "$WRK_PID" 2>/dev/null || true
        wait "$WRK_PID" || true
        WRK_PID=""
        [ "$rc" -eq 0 ] || die "$variant loaded run exited $rc; see $base.loaded.stdout.stderr"
        local served bad
        served="$(sed -n 's/^served=//p' "$base.loaded.stdout")"
        bad="$(non_2xx "$base.wrk")"
        # The N-th request starts the graceful shutdown; requests already
        # read on the keep-alive connections are still served (a handful
        # more), and the arithmetic divides by what was served.
        [ -n "$served" ] && [ "$served" -ge "$REQUESTS" ] &&
            [ "$served" -le $((REQUESTS + REQUESTS / 100 + CONNECTIONS)) ] ||
            die "$variant served ${served:-?} requests, expected $REQUESTS (plus a few in flight)"
        [ "$bad" -eq 0 ] || die "$variant: wrk saw $bad non-2xx responses"
        echo "    served $served in $((($(date +%s%N) - started) / 1000000)) ms under valgrind, non-2xx: $bad" >&2

        local hold=0
        [ "$HOLD_IDLE" = 1 ] && hold="$held_ms"
        echo "==> $variant: idle run (--requests 0, hold ${hold} ms) under callgrind" >&2
        start_server "$base.idle.stdout" valgrind --tool=callgrind \
            --callgrind-out-file="$base.idle.callgrind" \
            "$BIN" --variant "$variant" --requests 0 --hold-ms "$hold" --clock "$CLOCK"
        rc=0
        wait "$SERVER_PID" || rc=$?
        SERVER_PID=""
        [ "$rc" -eq 0 ] || die "$variant idle run exited $rc; see $base.idle.stdout.stderr"

        local loaded idle
        loaded="$(total_ir "$base.loaded.callgrind")"
        idle="$(total_ir "$base.idle.callgrind")"
        PER_REQ[$variant]="$(awk -v l="$loaded" -v i="$idle" -v n="$served" \
            'BEGIN { printf "%.1f", (l - i) / n }')"
        printf '%-9s %15s %15s %8s %12s\n' "$variant" "$loaded" "$idle" "$served" \
            "${PER_REQ[$variant]}" >>"$OUT/table.txt.tmp"
    done

    echo
    echo "Instructions per request (callgrind Ir; (loaded - idle) / served)"
    local bare="${PER_REQ[bare]:-}"
    {
        head -n 1 "$OUT/table.txt.tmp" | sed 's/$/   vs bare/'
        tail -n +2 "$OUT/table.txt.tmp" | while read -r v l i s p; do
            local ratio="n/a"
            [ -n "$bare" ] && ratio="$(awk -v p="$p" -v b="$bare" 'BEGIN { printf "%.3fx", p / b }')"
            printf '%-9s %15s %15s %8s %12s %9s\n' "$v" "$l" "$i" "$s" "$p" "$ratio"
        done
    } | tee "$OUT/table.txt"
    rm -f "$OUT/table.txt.tmp"

    local toll="${PER_REQ[tollgate]:-}" noop="${PER_REQ[noop]:-}" gov="${PER_REQ[governor]:-}"
    local floor="${PER_REQ[floor]:-}"
    [ -n "$toll" ] || return 0
    echo
    echo "Targets:"
    verdict() { if awk "BEGIN { exit !($1) }"; then echo PASS; else echo MISS; fi; }
    if [ -n "$bare" ]; then
        printf '  tollgate / bare     = %.3fx   (target <= 1.10x)   %s\n' \
            "$(awk -v t="$toll" -v b="$bare" 'BEGIN { print t / b }')" \
            "$(verdict "$toll / $bare <= 1.10")"
    fi
    if [ -n "$bare" ] && [ -n "$gov" ]; then
        printf '  tollgate vs governor: %.3fx vs %.3fx of bare (target: tollgate <= governor)   %s\n' \
            "$(awk -v t="$toll" -v b="$bare" 'BEGIN { print t / b }')" \
            "$(awk -v g="$gov" -v b="$bare" 'BEGIN { print g / b }')" \
            "$(verdict "$toll <= $gov")"
    fi
    if [ -n "$noop" ]; then
        printf '  tollgate - noop     = %.1f Ir/request   (target <= 400)   %s\n' \
            "$(awk -v t="$toll" -v n="$noop" 'BEGIN { print t - n }')" \
            "$(verdict "$toll - $noop <= 400")"
    fi
    if [ -n "$noop" ] && [ -n "$floor" ]; then
        echo
        echo "The floor (HTTP-side work of tollgate's surface, no accounting):"
        printf '  floor - noop        = %.1f Ir/request\n' \
            "$(awk -v f="$floor" -v n="$noop" 'BEGIN { print f - n }')"
        printf '  tollgate - floor    = %.1f Ir/request   (accounting: key, admission, commit, usage)\n' \
            "$(awk -v t="$toll" -v f="$floor" 'BEGIN { print t - f }')"
        [ -n "$bare" ] && printf '  floor / bare        = %.3fx\n' \
            "$(awk -v f="$floor" -v b="$bare" 'BEGIN { print f / b }')"
    fi
    echo
    echo "Profiles: callgrind_annotate --inclusive=yes $OUT/tollgate.loaded.callgrind"
}

ab() {
    local seconds="${AB_SECONDS:-3}"
    local ratios="$OUT/ab.ratios"
    : >"$ratios"
    printf '%4s %14s %14s %8s\n' pair "bare req/s" "tollgate req/s" ratio
    for pair in $(seq 1 "$PAIRS"); do
        local order="bare tollgate"
        [ $((pair % 2)) -eq 0 ] && order="tollgate bare"
        declare -A RPS
        for variant in $order; do
            start_server "$OUT/ab.$variant.stdout" "$BIN" --variant "$variant"
            wrk -c "$CONNECTIONS" -t 1 -d "${seconds}s" "${HEADER[@]}" \
                "http://$ADDR/" >"$OUT/ab.$variant.wrk" 2>&1
            kill -INT "$SERVER_PID"
            wait "$SERVER_PID" || die "$variant server failed; see $OUT/ab.$variant.stdout.stderr"
            SERVER_PID=""
            local bad
            bad="$(non_2xx "$OUT/ab.$variant.wrk")"
            [ "$bad" -eq 0 ] || die "$variant: wrk saw $bad non-2xx responses"
            RPS[$variant]="$(awk '/^Requests\/sec:/ { print $2 }' "$OUT/ab.$variant.wrk")"
        done
        local ratio
        ratio="$(awk -v t="${RPS[tollgate]}" -v b="${RPS[bare]}" 'BEGIN { printf "%.4f", t / b }')"
        echo "$ratio" >>"$ratios"
        printf '%4s %14s %14s %8s\n' "$pair" "${RPS[bare]}" "${RPS[tollgate]}" "$ratio"
    done
    sort -g "$ratios" | awk -v pairs="$PAIRS" '
        { r[NR] = $1 }
        END {
            m = (NR % 2) ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2
            printf "\nmedian tollgate/bare = %.4f over %d pairs (min %.4f, max %.4f)   sanity bound >= 0.95: %s\n",
                m, pairs, r[1], r[NR], (m >= 0.95 ? "PASS" : "MISS")
        }'
}

if [ "$MODE" = ab ]; then ab; else instructions; fi
