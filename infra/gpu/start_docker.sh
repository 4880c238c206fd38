#!/usr/bin/env bash
# Start a Docker engine on the lent GPU host from the bundle made by infra/gpu/docker_bundle.sh.
#
# What it does (as root, from the repo root; idempotent: with the engine up it only checks the
# image, ~3 s; with /tmp kept but the daemons gone it restarts them without reloading):
#   1. unpacks .gpu-docker/engine.tar.xz into $GPU_DOCKER_HOME (default /tmp/gpu-docker):
#      bin/ (dockerd, containerd, containerd-shim-runc-v2, runc, docker-init) and lib/ (their
#      non-glibc shared libraries); a soname the host lacks is copied into /usr/local/lib
#      (GPU_DOCKER_LIBDIR) + ldconfig, nothing the host has is replaced;
#   2. installs the docker SDK wheel into $GPU_DOCKER_SITE (default /tmp/site) with
#      `pip install --no-index --no-deps --target`; requests & co. only if the host's are
#      missing or too old. The CALLER must `export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}`;
#   3. starts containerd (own config, socket under $GPU_DOCKER_HOME) and dockerd with the
#      project's network policy (--bridge=none --iptables=false --ip-forward=false
#      --ip-masq=false --userland-proxy=false), data-root/exec-root/pidfile under
#      $GPU_DOCKER_HOME, API socket $GPU_DOCKER_SOCK (default /var/run/docker.sock, so
#      docker.from_env() needs no DOCKER_HOST), logs in $GPU_DOCKER_HOME/*.log. Both daemons
#      run in one private mount namespace (unshare -m), so their mounts vanish with them.
#      Storage drivers tried in order: overlay2 on disk, overlay2 on a tmpfs data-root (for a
#      host whose /tmp is itself overlayfs), vfs (slow but works anywhere);
#   4. loads flashpost/sandbox-base:<recipe hash> (+ :latest) from .gpu-docker-image*/ through
#      the SDK (no CLI), so envs.engine.ensure_base_image() finds the tag and never runs
#      debootstrap there; it refuses a bundle made from another base_image.recipe;
#   5. smoke-tests: a plain container (network none) decides the storage driver, then one
#      hardened container through envs.engine (limits, read-only root, tmpfs volume, exec,
#      put_archive) must work too, or it says why (usually cgroup controllers).
# Host preparation it may do: on cgroup v2 in a cgroup namespace whose root lacks the cpu/
# memory/pids controllers in cgroup.subtree_control, it moves this namespace's processes into
# /sys/fs/cgroup/init and enables them (as docker-in-docker does; GPU_DOCKER_CGROUP_FIX=0 skips).
# If AppArmor is enabled in the kernel but apparmor_parser is missing, it hides
# /sys/kernel/security from the daemons (inside their mount namespace only).
# What it does not do: install anything from a network, touch GPUs, give containers a
# network, or build images (task images are layered by envs/ through the engine as usual).
#
# Usage: bash infra/gpu/start_docker.sh            start (or confirm) the engine
#        bash infra/gpu/start_docker.sh --stop     stop the daemons it started
# The daemons are detached (setsid, output to log files); if the `run` tool waits for them,
# end each call with `--stop` (the data root stays in /tmp, so the next start is quick).
# Env: GPU_DOCKER_HOME GPU_DOCKER_SITE GPU_DOCKER_SOCK GPU_DOCKER_BUNDLE (default ./.gpu-docker)
#      GPU_DOCKER_DRIVERS ("overlay2 overlay2-tmpfs vfs") GPU_DOCKER_TMPFS_SIZE (32g)
#      GPU_DOCKER_WAIT_S (60) GPU_DOCKER_CGROUP_PARENT GPU_DOCKER_PYTHON (python3)
#      GPU_DOCKER_SMOKE (1; 0 skips step 5) GPU_DOCKER_APPARMOR (auto|mask|off)
set -euo pipefail

ROOT=$(pwd)
HOME_DIR=${GPU_DOCKER_HOME:-/tmp/gpu-docker}
SITE=${GPU_DOCKER_SITE:-/tmp/site}
SOCK=${GPU_DOCKER_SOCK:-/var/run/docker.sock}
BUNDLE=${GPU_DOCKER_BUNDLE:-$ROOT/.gpu-docker}
DRIVERS=${GPU_DOCKER_DRIVERS:-overlay2 overlay2-tmpfs vfs}
TMPFS_SIZE=${GPU_DOCKER_TMPFS_SIZE:-32g}
WAIT_S=${GPU_DOCKER_WAIT_S:-60}
PYTHON=${GPU_DOCKER_PYTHON:-python3}
SMOKE=${GPU_DOCKER_SMOKE:-1}
APPARMOR=${GPU_DOCKER_APPARMOR:-auto}
CTD_DIR=$HOME_DIR/containerd
CTD_SOCK=$CTD_DIR/containerd.sock
RUN=$HOME_DIR/run
export DOCKER_HOST=unix://$SOCK
PYENV=(env "PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}" "DOCKER_HOST=$DOCKER_HOST")

t0=$(date +%s.%N)
say() { echo "[start_docker] $*" >&2; }
die() { say "ERROR: $*"; exit 1; }
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }
py() { "${PYENV[@]}" "$PYTHON" "$@"; }
ping_engine() { py -c 'import docker; docker.from_env(timeout=5).ping()' >/dev/null 2>&1; }

stop_daemons() {
    local name pid i
    for name in dockerd containerd; do
        pid=$(cat "$RUN/$name.launch.pid" 2>/dev/null || true)
        [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || { rm -f "$RUN/$name.launch.pid"; continue; }
        say "stopping $name (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name did not stop in 30s; SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$RUN/$name.launch.pid"
    done
    # Shims left by a killed containerd: only those whose parent address is ours.
    for pid in $(pgrep -f "containerd-shim-runc-v2 .*-address $CTD_SOCK" 2>/dev/null || true); do
        kill -KILL "$pid" 2>/dev/null || true
    done
    rm -f "$SOCK"
}

if [[ ${1:-} == --stop ]]; then
    stop_daemons
    say "stopped; $(elapsed)s"
    exit 0
fi
[[ $# -eq 0 ]] || die "unknown argument $1 (use --stop or nothing)"

# ------------------------------------------------------------------------------ checks
[[ $(id -u) -eq 0 ]] || die "must run as root (dockerd needs it)"
[[ -f $ROOT/infra/docker/base_image.recipe ]] || die "run from the repo root (no infra/docker/base_image.recipe in $ROOT)"
[[ -f $BUNDLE/engine.tar.xz ]] || die "$BUNDLE/engine.tar.xz missing: build it with infra/gpu/docker_bundle.sh and carry .gpu-docker"
command -v "$PYTHON" >/dev/null || die "no $PYTHON"
for tool in tar xz; do command -v $tool >/dev/null || die "$tool is missing on this host"; done

# ----------------------------------------------------------------------- 1. binaries
mkdir -p "$HOME_DIR" "$RUN" "$CTD_DIR"
key=$(cat "$BUNDLE/engine.key" 2>/dev/null || sha256sum "$BUNDLE/engine.tar.xz" | cut -c1-16)
if [[ $(cat "$HOME_DIR/engine.key" 2>/dev/null) != "$key" || ! -x $HOME_DIR/bin/dockerd ]]; then
    if [[ -f $RUN/dockerd.launch.pid ]] && kill -0 "$(cat "$RUN/dockerd.launch.pid")" 2>/dev/null; then
        say "bundle changed while the engine runs; stopping it first"
        stop_daemons
    fi
    say "unpacking $BUNDLE/engine.tar.xz into $HOME_DIR"
    rm -rf "${HOME_DIR:?}/bin" "${HOME_DIR:?}/lib"
    xz -dc "$BUNDLE/engine.tar.xz" | tar -C "$HOME_DIR" -xf -
    echo "$key" >"$HOME_DIR/engine.key"
fi
DPATH=$HOME_DIR/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DENV=(env "PATH=$DPATH")
# Shared libraries the host lacks (e.g. libdevmapper, libseccomp on a slim image): copy just
# those sonames from the bundle into $LIBDIR and run ldconfig. Nothing the host has is
# replaced, and no LD_LIBRARY_PATH is needed (runc re-executes itself with a clean env).
LIBDIR=${GPU_DOCKER_LIBDIR:-/usr/local/lib}
list_deps() {
    if command -v ldd >/dev/null; then ldd "$1" 2>&1
    else /lib64/ld-linux-x86-64.so.2 --list "$1" 2>&1; fi
}
for _ in 1 2 3; do
    missing=$(for b in dockerd containerd containerd-shim-runc-v2 runc; do list_deps "$HOME_DIR/bin/$b"; done \
        | awk '/=> not found/{print $1}' | sort -u)
    [[ -n $missing ]] || break
    for so in $missing; do
        [[ -f $HOME_DIR/lib/$so ]] || die "the host lacks $so and the bundle has no copy of it"
        say "host lacks $so: installing the bundled copy into $LIBDIR"
        mkdir -p "$LIBDIR"
        cp "$HOME_DIR/lib/$so" "$LIBDIR/$so"
    done
    ldconfig "$LIBDIR" 2>/dev/null || ldconfig || die "ldconfig failed after adding libraries to $LIBDIR"
done
for b in dockerd containerd containerd-shim-runc-v2 runc; do
    vflag=--version; [[ $b == containerd-shim-runc-v2 ]] && vflag=-v
    "${DENV[@]}" "$HOME_DIR/bin/$b" $vflag >/dev/null 2>&1 || {
        "${DENV[@]}" "$HOME_DIR/bin/$b" $vflag 2>&1 | head -3 >&2 || true
        die "$b from the bundle does not run here (it needs glibc >= 2.34; host: $(ldd --version 2>&1 | head -1))"
    }
done

# -------------------------------------------------------------------------- 2. the SDK
mapfile -t wheels < <(ls "$BUNDLE"/wheels/*.whl 2>/dev/null)
((${#wheels[@]})) || die "no wheels in $BUNDLE/wheels (re-run infra/gpu/docker_bundle.sh)"
pick() { printf '%s\n' "${wheels[@]}" | grep -E "/$1-[0-9]" | head -1; }
install_wheels() {
    mkdir -p "$SITE"
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        PIP_ROOT_USER_ACTION=ignore "$PYTHON" -m pip install -q --no-index --no-deps --disable-pip-version-check --upgrade \
            --target "$SITE" "$@" >/dev/null || die "pip install --target $SITE failed for: $*"
    else  # a pure-Python wheel is a zip of the package: unzip is an install for import purposes
        local w
        for w in "$@"; do "$PYTHON" -m zipfile -e "$w" "$SITE" || die "cannot unzip $w"; done
    fi
}
docker_whl=$(pick docker || true)
[[ -n $docker_whl ]] || die "no docker-*.whl in $BUNDLE/wheels (re-run infra/gpu/docker_bundle.sh)"
want_docker=$(basename "$docker_whl" | cut -d- -f2)
have_docker=$(py -c 'import docker; print(docker.__version__)' 2>/dev/null || true)
if [[ $have_docker != "$want_docker" ]]; then
    # requests/urllib3: keep the host's if docker 7 can use them (requests >= 2.26, urllib3 >= 1.26).
    if ! py -c '
import requests, urllib3
v = lambda s: tuple(int(x) for x in s.split(".")[:2])
assert v(requests.__version__) >= (2, 26) and v(urllib3.__version__) >= (1, 26)
' 2>/dev/null; then
        say "host requests/urllib3 missing or too old: installing the bundled set into $SITE"
        deps=()
        for p in requests urllib3 charset_normalizer idna certifi; do
            w=$(pick "$p") || true
            [[ -n $w ]] || die "wheel for $p missing from $BUNDLE/wheels"
            deps+=("$w")
        done
        install_wheels "${deps[@]}"
    fi
    say "installing docker SDK $want_docker into $SITE"
    install_wheels "$docker_whl"
    have_docker=$(py -c 'import docker; print(docker.__version__)' 2>&1) \
        || die "import docker fails after install: $have_docker"
fi

# ------------------------------------------------------------------ 3. host preparation
cgroup_fix() {
    [[ ${GPU_DOCKER_CGROUP_FIX:-1} != 0 ]] || return 0
    local cg=/sys/fs/cgroup want=() c
    [[ -f $cg/cgroup.controllers ]] || return 0            # cgroup v1 / hybrid: nothing to do
    [[ $(cat /proc/self/cgroup) == "0::/" ]] || return 0   # not at a (namespace) root
    for c in cpu memory pids; do
        grep -qw "$c" "$cg/cgroup.subtree_control" || want+=("$c")
    done
    ((${#want[@]})) || return 0
    for c in "${want[@]}"; do
        grep -qw "$c" "$cg/cgroup.controllers" \
            || say "WARNING: cgroup controller '$c' is not available here; limits using it will fail"
    done
    say "enabling cgroup controllers ${want[*]} (moving this namespace's processes into $cg/init)"
    mkdir -p "$cg/init"
    local p
    for p in $(cat "$cg/cgroup.procs"); do echo "$p" >"$cg/init/cgroup.procs" 2>/dev/null || true; done
    for c in $(cat "$cg/cgroup.controllers"); do
        echo "+$c" >"$cg/cgroup.subtree_control" 2>/dev/null && continue
        [[ " ${want[*]} " == *" $c "* ]] && say "WARNING: could not enable cgroup controller $c"
    done
    say "cgroup.subtree_control now: $(cat "$cg/cgroup.subtree_control")"
}

use_mask=0
if [[ $APPARMOR == mask ]]; then
    use_mask=1
elif [[ $APPARMOR == auto && -d /sys/kernel/security/apparmor ]] \
    && grep -q '^Y' /sys/module/apparmor/parameters/enabled 2>/dev/null \
    && ! command -v apparmor_parser >/dev/null; then
    say "AppArmor is enabled but apparmor_parser is missing: hiding it from the daemons"
    use_mask=1
fi

# --------------------------------------------------------------------- 3. the daemons
write_configs() {
    cat >"$CTD_DIR/config.toml" <<EOF
version = 2
root = "$CTD_DIR/root"
state = "$CTD_DIR/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$CTD_SOCK"
[ttrpc]
  address = "$CTD_SOCK.ttrpc"
[debug]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$CTD_DIR/opt"
EOF
    echo '{}' >"$RUN/daemon.json"
    # One launcher in one (private) mount namespace: containerd in the background, then exec
    # dockerd, so dockerd's rootfs/volume mounts are visible to runc under the shims.
    cat >"$RUN/launch.sh" <<'EOF'
#!/usr/bin/env bash
# args: mask(0|1) tmpfs_dir(or -) tmpfs_size then the dockerd command line
set -u
mask=$1 tmpfs_dir=$2 tmpfs_size=$3; shift 3
if [[ $mask == 1 ]]; then mount -t tmpfs -o size=1m,mode=0755 gpu-docker-noaa /sys/kernel/security || exit 90; fi
if [[ $tmpfs_dir != - ]]; then
    mkdir -p "$tmpfs_dir"
    mountpoint -q "$tmpfs_dir" || mount -t tmpfs -o "size=$tmpfs_size,mode=0710" gpu-docker-data "$tmpfs_dir" || exit 91
fi
containerd --config "$CTD_CONFIG" >>"$CTD_LOG" 2>&1 </dev/null &
echo $! >"$CTD_PIDFILE"
for ((i = 0; i < 100; i++)); do [[ -S $CTD_SOCK ]] && break; kill -0 $! 2>/dev/null || exit 92; sleep 0.2; done
[[ -S $CTD_SOCK ]] || exit 93
exec "$@"
EOF
}

start_with() {  # $1 = driver spec; returns 0 when the engine answers
    local spec=$1 driver data tmpfs_dir=- pid deadline
    case $spec in
        overlay2) driver=overlay2 data=$HOME_DIR/data-overlay2 ;;
        overlay2-tmpfs) driver=overlay2 data=$HOME_DIR/data-tmpfs tmpfs_dir=$HOME_DIR/data-tmpfs ;;
        vfs) driver=vfs data=$HOME_DIR/data-vfs ;;
        fuse-overlayfs) command -v fuse-overlayfs >/dev/null || { say "no fuse-overlayfs binary; skipping"; return 1; }
                        driver=fuse-overlayfs data=$HOME_DIR/data-fuse ;;
        *) die "unknown storage driver spec '$spec' in GPU_DOCKER_DRIVERS" ;;
    esac
    if [[ $tmpfs_dir != - ]] && ((use_ns == 0)); then
        say "overlay2-tmpfs needs a private mount namespace (unshare); skipping"; return 1
    fi
    mkdir -p "$data" "$HOME_DIR/exec" "$(dirname "$SOCK")"
    rm -f "$SOCK" "$CTD_SOCK" "$RUN/dockerd.pid"
    local cmd=(dockerd --config-file "$RUN/daemon.json" --host "unix://$SOCK"
        --containerd "$CTD_SOCK" --data-root "$data" --exec-root "$HOME_DIR/exec"
        --pidfile "$RUN/dockerd.pid" --storage-driver "$driver"
        --bridge=none --iptables=false --ip-forward=false --ip-masq=false --userland-proxy=false
        --init-path "$HOME_DIR/bin/docker-init" --exec-opt native.cgroupdriver=cgroupfs)
    [[ -n ${GPU_DOCKER_CGROUP_PARENT:-} ]] && cmd+=(--cgroup-parent "$GPU_DOCKER_CGROUP_PARENT")
    local ns=()
    ((use_ns)) && ns=(unshare --mount --propagation private)
    say "starting containerd + dockerd (storage $spec, data-root $data), logs $HOME_DIR/{containerd,dockerd}.log"
    echo "=== $(date -u +%FT%TZ) start_docker: $spec" | tee -a "$HOME_DIR/dockerd.log" >>"$HOME_DIR/containerd.log"
    "${DENV[@]}" CTD_CONFIG="$CTD_DIR/config.toml" CTD_LOG="$HOME_DIR/containerd.log" \
        CTD_PIDFILE="$RUN/containerd.launch.pid" CTD_SOCK="$CTD_SOCK" \
        setsid nohup "${ns[@]}" bash "$RUN/launch.sh" "$use_mask" "$tmpfs_dir" "$TMPFS_SIZE" "${cmd[@]}" \
        >>"$HOME_DIR/dockerd.log" 2>&1 </dev/null &
    pid=$!
    echo "$pid" >"$RUN/dockerd.launch.pid"   # same process as dockerd (setsid/nohup/unshare/bash exec)
    deadline=$((SECONDS + WAIT_S))
    while ((SECONDS < deadline)); do
        if ping_engine; then echo "$spec" >"$HOME_DIR/driver"; return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then
            local rc=0
            wait "$pid" 2>/dev/null || rc=$?
            say "dockerd exited (rc $rc) with storage $spec; last lines of $HOME_DIR/dockerd.log:"
            tail -n 5 "$HOME_DIR/dockerd.log" >&2
            stop_daemons
            return 1
        fi
        sleep 0.5
    done
    say "dockerd did not answer within ${WAIT_S}s with storage $spec; stopping it"
    stop_daemons
    return 1
}

IMG_DIRS=("$ROOT"/.gpu-docker-image "$ROOT"/.gpu-docker-image[0-9]*)
load_image() {  # loads the bundled image unless the expected tag is already there
    local want info
    want=$(py -c 'from envs import engine; print(engine.base_image_tag())')
    if py -c "import docker,sys; docker.from_env().images.get('$want')" >/dev/null 2>&1; then
        say "base image $want already loaded"
        return 0
    fi
    info=${IMG_DIRS[0]}/IMAGE
    [[ -f $info ]] || die "$info missing: carry .gpu-docker-image (made by infra/gpu/docker_bundle.sh)"
    local tag parts p f files=()
    tag=$(sed -n 's/^tag=//p' "$info")
    [[ $tag == "$want" ]] || die "the bundled image is $tag but this checkout's base_image.recipe wants $want: re-run infra/gpu/docker_bundle.sh"
    parts=$(sed -n 's/^parts=//p' "$info")
    for p in $parts; do
        f=""
        for d in "${IMG_DIRS[@]}"; do [[ -f $d/$p ]] && { f=$d/$p; break; }; done
        [[ -n $f ]] || die "image part $p missing: carry all of .gpu-docker-image* (one per run call if needed)"
        files+=("$f")
    done
    say "checking and loading $tag from ${files[*]}"
    [[ $(cat "${files[@]}" | sha256sum | cut -d' ' -f1) == "$(sed -n 's/^xz_sha256=//p' "$info")" ]] \
        || die "image bundle checksum mismatch (a part is missing or truncated)"
    py - "$tag" "${files[@]}" <<'EOF'
import subprocess, sys, docker
tag, files = sys.argv[1], sys.argv[2:]
cat = subprocess.Popen(["cat", *files], stdout=subprocess.PIPE)
xz = subprocess.Popen(["xz", "-dc"], stdin=cat.stdout, stdout=subprocess.PIPE)
cat.stdout.close()
def chunks():
    while block := xz.stdout.read(1 << 20):
        yield block
client = docker.from_env(timeout=600)
images = client.images.load(chunks())
if xz.wait() != 0 or cat.wait() != 0:
    sys.exit("xz -dc of the image bundle failed")
client.images.get(tag)  # raises ImageNotFound if the tag did not come with it
print(f"loaded {sorted({t for i in images for t in i.tags})}", file=sys.stderr)
EOF
}

smoke_basic() {
    py - <<'EOF'
import sys, docker
from envs import engine
out = docker.from_env(timeout=120).containers.run(
    engine.base_image_tag(), ["sh", "-c", "echo gpu-docker-ok"], network_mode="none", init=True,
    remove=True, labels={engine.LABEL_OWNER: engine.owner_id(), engine.LABEL_ROLE: "smoke"})
assert out.strip() == b"gpu-docker-ok", out
EOF
}

smoke_hardened() {
    py - <<'EOF'
from envs import engine
tag = engine.ensure_base_image(build=False)
spec = engine.ContainerSpec(
    image=tag, command=["sleep", "120"], user="root", workdir="/workspace", role="smoke",
    lifetime_s=300, mem_limit="256m", pids_limit=64, nano_cpus=1_000_000_000,
    tmpfs_volumes={"/workspace": "size=16m,uid=1000,gid=1000,mode=0755"})
cid = engine.start_container(spec)
try:
    engine.put_archive(cid, "/workspace", engine.tar_files({"hello.txt": b"hi\n"}))
    eid = engine.exec_create(cid, ["sh", "-c", "cat hello.txt && id -u && python3 -c 'print(6*7)'"],
                             user="agent", workdir="/workspace", env={})
    out = b"".join(engine.exec_stream(eid))
    assert engine.exec_exit_code(eid) == 0 and out.split() == [b"hi", b"1000", b"42"], out
finally:
    engine.remove_container(cid)
EOF
}

if ping_engine; then
    say "an engine already answers on $SOCK"
    load_image
    say "ready ($(elapsed)s): export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}; DOCKER_HOST=$DOCKER_HOST"
    exit 0
fi
[[ -f $RUN/dockerd.launch.pid ]] && kill -0 "$(cat "$RUN/dockerd.launch.pid")" 2>/dev/null && {
    say "a dockerd we started is running but does not answer; restarting it"; stop_daemons; }

cgroup_fix
use_ns=1
if ! unshare --mount --propagation private true 2>/dev/null; then
    ((use_mask)) && die "AppArmor must be hidden from dockerd but unshare -m does not work here (set GPU_DOCKER_APPARMOR=off to try anyway)"
    say "WARNING: unshare -m does not work; daemons run in the host mount namespace"
    use_ns=0
fi
write_configs

order=()
prev=$(cat "$HOME_DIR/driver" 2>/dev/null || true)
[[ -n $prev ]] && [[ " $DRIVERS " == *" $prev "* ]] && order+=("$prev")
for d in $DRIVERS; do [[ $d == "$prev" ]] || order+=("$d"); done

started=""
for spec in "${order[@]}"; do
    start_with "$spec" || continue
    load_image
    if [[ $SMOKE == 0 ]]; then started=$spec; break; fi
    if err=$(smoke_basic 2>&1); then started=$spec; break; fi
    say "a plain container fails with storage $spec: $(echo "$err" | tail -n 3)"
    stop_daemons
    rm -f "$HOME_DIR/driver"
done
[[ -n $started ]] || die "no storage driver worked (tried: ${order[*]}); see $HOME_DIR/dockerd.log and containerd.log"
[[ $started == overlay2 ]] || say "WARNING: running with storage '$started' (overlay2 on disk did not work)"

if [[ $SMOKE != 0 ]]; then
    if ! err=$(smoke_hardened 2>&1); then
        echo "$err" | tail -n 8 >&2
        die "the engine runs (storage $started) but a hardened container (memory/pids/cpu limits, tmpfs volume) fails; check cgroup controllers: $(cat /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || echo 'cgroup v1')"
    fi
    say "smoke tests passed (plain + hardened container)"
fi
say "ready ($(elapsed)s, storage $started, no bridge, no iptables): export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}; DOCKER_HOST=$DOCKER_HOST"
