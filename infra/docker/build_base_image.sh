#!/usr/bin/env bash
# Build the sandbox base image from Debian packages (no image registry) and cache it by hash.
#
# debootstrap --variant=minbase from the Debian mirror the host's apt already uses, configure it
# with recipe_configure() from base_image.recipe, trim it, and `docker import` it as
# flashpost/sandbox-base:<sha256(base_image.recipe)[:12]> (+ :latest). A second run finds the
# tag and returns in well under a second. Not here: starting the engine (ensure_engine.sh)
# and task images (envs/fixtures/build.py layers them on top of this one).
#
# Usage: bash infra/docker/build_base_image.sh [--print-tag] [--force]
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RECIPE=$HERE/base_image.recipe
REPO=flashpost/sandbox-base
HASH=$(sha256sum "$RECIPE" | cut -c1-12)
TAG=$REPO:$HASH
say() { echo "[build_base_image] $*" >&2; }
t0=$(date +%s.%N)
elapsed() { awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.1f", b-a}'; }

force=0
for arg in "$@"; do
    case $arg in
        --print-tag) echo "$TAG"; exit 0 ;;
        --force) force=1 ;;
        *) say "unknown argument: $arg (use --print-tag or --force)"; exit 2 ;;
    esac
done

docker info >/dev/null 2>&1 || { say "ERROR: no Docker engine; run: bash $HERE/ensure_engine.sh"; exit 1; }

# Serialise concurrent builders (parallel test sessions, make targets).
exec 9>/var/lock/flashpost-base-image.lock
flock 9

if ((force == 0)) && docker image inspect "$TAG" >/dev/null 2>&1; then
    docker tag "$TAG" "$REPO:latest"
    say "cached: $TAG ($(elapsed)s)"
    echo "$TAG"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || { say "ERROR: building the base image needs root (debootstrap, chroot)"; exit 1; }
command -v debootstrap >/dev/null 2>&1 || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
        || { say "ERROR: cannot install debootstrap"; exit 1; }
}

# shellcheck source=base_image.recipe
source "$RECIPE"

# The mirror the host's apt uses for the main archive (deb822 .sources or one-line .list).
find_mirror() {
    local f
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        awk '/^URIs:/{print $2}' "$f"
    done
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        awk '$1=="deb"{for(i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; break}}' "$f"
    done
}
MIRROR=$(find_mirror | grep -v -- '-security' | grep -m1 -E '/debian/?$' || true)
[[ -n $MIRROR ]] || { say "ERROR: no Debian main-archive mirror found in /etc/apt/sources*"; exit 1; }

WORK=$(mktemp -d /var/tmp/flashpost-rootfs.XXXXXX)
cleanup() {
    for m in proc sys dev; do umount -l "$WORK/rootfs/$m" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
ROOTFS=$WORK/rootfs

say "debootstrap --variant=$VARIANT $SUITE from $MIRROR (include: $INCLUDE)"
if ! debootstrap --variant="$VARIANT" --include="$INCLUDE" "$SUITE" "$ROOTFS" "$MIRROR" \
        >"$WORK/debootstrap.log" 2>&1; then
    tail -n 30 "$WORK/debootstrap.log" >&2
    cp "$WORK/debootstrap.log" /tmp/flashpost-debootstrap.log
    say "ERROR: debootstrap failed (full log: /tmp/flashpost-debootstrap.log)"
    exit 1
fi
t_boot=$(elapsed)
say "debootstrap done (${t_boot}s)"

# The test environment's wheels, fetched here (the chroot has no index to ask); recipe_configure
# unpacks them.
mkdir -p "$ROOTFS/tmp/wheels"
# shellcheck disable=SC2086 # TEST_WHEELS is a space-separated list of requirements
if ! python3 -m pip download --no-deps --only-binary :all: -q -d "$ROOTFS/tmp/wheels" $TEST_WHEELS \
        >"$WORK/wheels.log" 2>&1; then
    tail -n 20 "$WORK/wheels.log" >&2
    say "ERROR: pip download of the test wheels failed ($TEST_WHEELS); the host needs python3 -m pip and PyPI"
    exit 1
fi

# Run the recipe's configure step inside the chroot with the recipe itself as the script.
cp "$RECIPE" "$ROOTFS/tmp/recipe.sh"
chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
    /bin/bash -c 'source /tmp/recipe.sh && recipe_configure'
rm -f "$ROOTFS/tmp/recipe.sh"

changes=()
for c in "${IMAGE_CHANGES[@]}"; do changes+=(--change "$c"); done
say "importing as $TAG"
tar --numeric-owner --xattrs -C "$ROOTFS" -c . \
    | docker import "${changes[@]}" --message "flashpost sandbox base (recipe $HASH)" - "$TAG" >/dev/null
docker tag "$TAG" "$REPO:latest"
size=$(docker image inspect "$TAG" --format '{{.Size}}')
say "built $TAG: $((size / 1024 / 1024)) MiB; debootstrap ${t_boot}s, total $(elapsed)s"
echo "$TAG"
