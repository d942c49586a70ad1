#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-bench, llama-quantize and llama-speculative-simple for the peer benchmark
# (bench/bench_server_peers.py), from the llama.cpp source vendored in the pinned PyPI sdist llama-cpp-python==0.3.36
# (vendor/llama.cpp; llama.cpp@0c1e57098 according to the sdist's CHANGELOG):
#
#   bash bench/build_llama_cpp.sh                 # fetch, verify, configure, build; prints the binaries' dir last
#   bash bench/build_llama_cpp.sh --fetch-only    # only download, verify and unpack the source
#   LLAMA_CPP_SDIST=/path/llama_cpp_python-0.3.36.tar.gz bash bench/build_llama_cpp.sh   # a local copy of the sdist
#
# Where: ${SPECDRAFT_HOME:-$HOME/.cache/specdraft}/llama.cpp/llama-cpp-python-0.3.36/ holds the sdist (sdist/), the
# unpacked source (src/), the cmake build (build/, binaries in build/bin/) and BUILD_INFO (what was built, how).
# Cached: when the four binaries exist, a rerun builds nothing and only prints build/bin. Delete the dir to rebuild.
#
# How: `pip download --no-deps --no-binary :all:` of the sdist, checked against its PyPI sha256 (--require-hashes);
# cmake Release, -march=native (GGML_NATIVE), static libraries, CPU backend only, offline: no libcurl, no OpenSSL,
# no web UI (the tree would otherwise try to download prebuilt UI assets), no tests; `cmake --build -j 2` of the
# four targets only. About 10-15 minutes on 2 cores (gcc 12, cmake >= 3.14).
#
# Why it is not a dependency: llama.cpp is the *peer* the draft server is measured against, not something specdraft
# runs. Neither the package, its tests nor CI need it; only this benchmark does, so it is built on demand here
# rather than pinned in pyproject.toml (the llama-cpp-python wheel would give the library, not llama-server).
set -euo pipefail

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e   # llama_cpp_python-0.3.36.tar.gz on PyPI
TARGETS=(llama-server llama-bench llama-quantize llama-speculative-simple)
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}

ROOT="${SPECDRAFT_HOME:-$HOME/.cache/specdraft}/llama.cpp/llama-cpp-python-$VERSION"
ARCHIVE="$ROOT/sdist/llama_cpp_python-$VERSION.tar.gz"
SRC="$ROOT/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
BUILD="$ROOT/build"
BIN="$BUILD/bin"

log() { echo "build_llama_cpp: $*" >&2; }

built() {
    local t
    for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done
}

fetch() {
    [ -f "$SRC/CMakeLists.txt" ] && return 0
    mkdir -p "$ROOT/sdist" "$ROOT/src"
    if [ ! -f "$ARCHIVE" ]; then
        if [ -n "${LLAMA_CPP_SDIST:-}" ]; then
            log "copying $LLAMA_CPP_SDIST"
            cp "$LLAMA_CPP_SDIST" "$ARCHIVE.part"
        else
            log "downloading llama-cpp-python==$VERSION (sdist) from PyPI"
            local req="$ROOT/sdist/requirements.txt"
            echo "llama-cpp-python==$VERSION --hash=sha256:$SHA256" > "$req"
            "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
                --require-hashes -r "$req" -d "$ROOT/sdist"
            mv "$ARCHIVE" "$ARCHIVE.part"
        fi
        echo "$SHA256  $ARCHIVE.part" | sha256sum --check --quiet \
            || { log "sha256 of the sdist is not $SHA256"; rm -f "$ARCHIVE.part"; exit 1; }
        mv "$ARCHIVE.part" "$ARCHIVE"
    fi
    log "unpacking $ARCHIVE"
    rm -rf "$ROOT/src.part" && mkdir -p "$ROOT/src.part"
    tar -xzf "$ARCHIVE" -C "$ROOT/src.part"
    [ -f "$ROOT/src.part/llama_cpp_python-$VERSION/vendor/llama.cpp/tools/server/CMakeLists.txt" ] \
        || { log "the sdist has no vendor/llama.cpp/tools/server"; exit 1; }
    rm -rf "$ROOT/src" && mv "$ROOT/src.part" "$ROOT/src"
}

# the llama.cpp commit the sdist vendors, from its CHANGELOG ("update llama.cpp to ggml-org/llama.cpp@HASH")
llama_commit() {
    awk -v v="## [$VERSION]" '$0 == v {on = 1; next} on && /^## / {exit}
        on && match($0, /llama\.cpp@[0-9a-f]+/) {print substr($0, RSTART + 10, RLENGTH - 10); exit}' \
        "$SRC/../../CHANGELOG.md"
}

if built; then
    log "cached: ${TARGETS[*]} in $BIN"
    echo "$BIN"
    exit 0
fi

fetch
if [ "${1:-}" = "--fetch-only" ]; then
    echo "$SRC"
    exit 0
fi

COMMIT=$(llama_commit || true)
# the sdist is no git checkout: keep cmake's `git rev-parse` from finding an enclosing repository
export GIT_CEILING_DIRECTORIES="$ROOT/src"
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON
    -DLLAMA_CURL=OFF            # older trees' libcurl model download; this tree has none and ignores the flag
    -DLLAMA_OPENSSL=OFF         # HTTPS in cpp-httplib; not needed on 127.0.0.1
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF # else the configure step downloads the web UI from a Hugging Face bucket
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_EXAMPLES=ON   # llama-speculative-simple
    -DLLAMA_BUILD_SERVER=ON
    -DBUILD_SHARED_LIBS=OFF     # self-contained binaries
    -DLLAMA_BUILD_COMMIT="${COMMIT:-unknown}"
)
log "configuring llama.cpp@${COMMIT:-unknown} in $BUILD"
cmake -S "$SRC" -B "$BUILD" "${CMAKE_FLAGS[@]}" > "$ROOT/cmake-configure.log" 2>&1 \
    || { tail -40 "$ROOT/cmake-configure.log" >&2; exit 1; }
log "building ${TARGETS[*]} (-j $JOBS; log: $ROOT/cmake-build.log)"
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" > "$ROOT/cmake-build.log" 2>&1 \
    || { tail -40 "$ROOT/cmake-build.log" >&2; exit 1; }
built || { log "build finished but binaries are missing in $BIN"; exit 1; }

{
    echo "source: llama-cpp-python==$VERSION sdist (sha256 $SHA256), vendor/llama.cpp"
    echo "llama.cpp commit (sdist CHANGELOG): ${COMMIT:-unknown}"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -srm), $(cmake --version | head -1), $(c++ --version | head -1)"
    echo "cmake flags: ${CMAKE_FLAGS[*]}"
    echo "targets: ${TARGETS[*]}"
    "$BIN/llama-server" --version 2>&1 | tail -n 2
} > "$ROOT/BUILD_INFO"
log "built; $(tr '\n' ' ' < "$ROOT/BUILD_INFO")"
echo "$BIN"
