#!/usr/bin/env bash
# Make sure a local Docker engine answers, starting one if needed (idempotent).
#
# What it does: if `docker info` works it exits 0 at once. Otherwise, as root on Debian, it
# installs docker.io (+ debootstrap for the base image) with apt, and starts dockerd in the
# background with NO default bridge, NO iptables/NAT and NO ip forwarding, so containers can
# only ever be created with `--network none` and the host sends no traffic for them.
# Storage driver: overlay2, falling back to fuse-overlayfs, then vfs (slow), with a message.
# What it does not do: pull images (no registry is assumed) or build the sandbox base image
# (that is infra/docker/build_base_image.sh).
#
# Usage: bash infra/docker/ensure_engine.sh          (log: /var/log/flashpost-dockerd.log)
set -euo pipefail

LOG=${FLASHPOST_DOCKERD_LOG:-/var/log/flashpost-dockerd.log}
WAIT_S=${FLASHPOST_DOCKERD_WAIT_S:-60}
t0=$(date +%s.%N)
say() { echo "[ensure_engine] $*" >&2; }
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

check_no_bridge() {
    if ip link show docker0 >/dev/null 2>&1; then
        say "ERROR: interface docker0 exists; dockerd must run with --bridge=none." \
            "Stop the engine that created it (it was not started by this script)."
        exit 1
    fi
}

if docker info >/dev/null 2>&1; then
    check_no_bridge
    say "engine already running ($(docker info --format '{{.Driver}}') storage); $(elapsed)s"
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    say "ERROR: no Docker engine answers and this script is not root."
    say "Start one yourself (dockerd --bridge=none --iptables=false --ip-forward=false)," \
        "or run this script as root: sudo bash infra/docker/ensure_engine.sh"
    exit 1
fi
if ! grep -qi '^ID=debian' /etc/os-release 2>/dev/null; then
    say "ERROR: no Docker engine answers and this is not Debian; install Docker yourself and" \
        "start dockerd with --bridge=none --iptables=false --ip-forward=false, then re-run."
    exit 1
fi

need_pkgs=()
command -v dockerd >/dev/null 2>&1 || need_pkgs+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_pkgs+=(debootstrap)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
if ((${#need_pkgs[@]})); then
    say "installing ${need_pkgs[*]} with apt-get"
    # Keep the package's init scripts from starting a default (bridged) dockerd.
    created_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod +x /usr/sbin/policy-rc.d
        created_policy=1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q --no-install-recommends "${need_pkgs[@]}" >/tmp/flashpost-apt.log 2>&1; then
        apt-get update -q >>/tmp/flashpost-apt.log 2>&1
        apt-get install -y -q --no-install-recommends "${need_pkgs[@]}" >>/tmp/flashpost-apt.log 2>&1 \
            || { say "ERROR: apt-get install failed, see /tmp/flashpost-apt.log"; exit 1; }
    fi
    ((created_policy)) && rm -f /usr/sbin/policy-rc.d
    say "packages installed; $(elapsed)s"
fi

start_dockerd() {  # $1 = storage driver; returns 0 when `docker info` answers with that driver
    local driver=$1
    say "starting dockerd (storage driver $driver), log $LOG"
    echo "=== $(date -u +%FT%TZ) flashpost: dockerd --storage-driver=$driver" >>"$LOG"
    # setsid + nohup: the daemon outlives this shell and the caller's process group.
    setsid nohup dockerd \
        --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
        --userland-proxy=false --storage-driver="$driver" \
        --host=unix:///var/run/docker.sock \
        >>"$LOG" 2>&1 </dev/null &
    local pid=$! deadline=$((SECONDS + WAIT_S))
    echo "$pid" >/var/run/flashpost-dockerd.pid
    while ((SECONDS < deadline)); do
        if docker info >/dev/null 2>&1; then
            return 0
        fi
        if ! kill -0 "$pid" 2>/dev/null; then
            say "dockerd exited with storage driver $driver (see $LOG)"
            return 1
        fi
        sleep 0.5
    done
    say "dockerd did not answer within ${WAIT_S}s with storage driver $driver; stopping it"
    kill "$pid" 2>/dev/null || true
    sleep 2
    return 1
}

started=""
for driver in overlay2 fuse-overlayfs vfs; do
    if [[ $driver == fuse-overlayfs ]] && ! command -v fuse-overlayfs >/dev/null 2>&1; then
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q fuse-overlayfs >>/tmp/flashpost-apt.log 2>&1 \
            || continue
    fi
    if start_dockerd "$driver"; then
        started=$driver
        break
    fi
done
if [[ -z $started ]]; then
    say "ERROR: dockerd did not start with overlay2, fuse-overlayfs or vfs; last lines of $LOG:"
    tail -n 20 "$LOG" >&2
    exit 1
fi
if [[ $started != overlay2 ]]; then
    say "WARNING: overlay2 does not work here; running with '$started' (container starts are slower)"
fi
check_no_bridge
say "engine up (storage driver $started, no bridge, no iptables); $(elapsed)s"
