#!/usr/bin/env bash
# Download the wheels the GPU check installs on the bare GPU machine (Python 3.12, no network): the pinned
# list in tests/gpu/wheels.txt, for CPython 3.12 on x86-64 Linux, without their dependencies. Run it on a
# networked machine, then carry the folder with the working tree (it must stay under 60 MiB):
#   bash tests/gpu/fetch_wheels.sh [DIR]      DIR: default tests/gpu/wheels (git-ignored)
# PY names the interpreter whose pip downloads (default python3; any version: the target is fixed).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${1:-$here/wheels}
PY=${PY:-python3}
limit_mib=60

pins=()
while read -r line; do
    line=${line%%#*}
    line=${line//[[:space:]]/}
    [[ -n $line ]] && pins+=("$line")
done <"$here/wheels.txt"
if [[ ${#pins[@]} -eq 0 ]]; then
    echo "fetch_wheels: no NAME==VERSION line in $here/wheels.txt" >&2
    exit 1
fi

mkdir -p "$dir"
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dir" "${pins[@]}"

# One version of each: drop the wheels in DIR that no pin names (an older version, a package no longer
# listed) or that CPython 3.12 cannot load (another Python's build).
norm() { tr '[:upper:]' '[:lower:]' <<<"$1" | sed -E 's/[-_.]+/_/g'; }
wanted=()
for pin in "${pins[@]}"; do
    wanted+=("$(norm "${pin%%==*}")-${pin#*==}")
done
for whl in "$dir"/*.whl; do
    base=$(basename "$whl")
    rest=${base#*-}
    key="$(norm "${base%%-*}")-${rest%%-*}"
    keep=0
    for w in "${wanted[@]}"; do
        [[ $w == "$key" ]] && keep=1
    done
    tags=${base%.whl}
    tags=${tags%-*}  # drop the platform tag
    abi=${tags##*-}
    tags=${tags%-*}
    fits=0
    IFS=. read -ra pythons <<<"${tags##*-}"
    for py in "${pythons[@]}"; do
        [[ $py == py3 || $py == cp312 ]] && fits=1
        [[ $abi == abi3 && $py =~ ^cp3([0-9]+)$ ]] && ((BASH_REMATCH[1] <= 12)) && fits=1
    done
    if [[ $keep -eq 0 || $fits -eq 0 ]]; then
        echo "fetch_wheels: removing $base (not in wheels.txt, or not for CPython 3.12)"
        rm -f "$whl"
    fi
done

ls -l "$dir"
bytes=$(du -sb "$dir" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
count=$(find "$dir" -maxdepth 1 -name '*.whl' | wc -l)
echo "fetch_wheels: $count wheels for ${#pins[@]} pins in $dir, $mib MiB"
if ((bytes > limit_mib * 1048576)); then
    echo "fetch_wheels: $dir is $mib MiB, over the $limit_mib MiB that may travel to the GPU machine" >&2
    exit 1
fi
