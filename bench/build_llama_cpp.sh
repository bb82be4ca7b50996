#!/usr/bin/env bash
# A native build of llama.cpp's libraries for this CPU (GGML_NATIVE: every instruction set it has),
# for the benches' second llama.cpp row beside the prebuilt wheel (whose Q4_0 / Q8_0 paths die of
# SIGILL on some AVX-512 CPUs):
#
#   bash bench/build_llama_cpp.sh [--amx] [OUT_DIR]  # default OUT_DIR: .llama-native
#   bash bench/build_llama_cpp.sh [--amx] --print-flags  # the instruction-set flags it would use
#   .venv/bin/python bench/vs_llama_cpp.py --llama-lib .llama-native
#
# It builds the llama.cpp that the installed llama-cpp-python wheel vendors (the same version, so
# the wheel's Python binding loads these libraries through LLAMA_CPP_LIB_PATH), from its source
# distribution on PyPI. Needs cmake and a C++ compiler; ~10-20 minutes on 2 cores.
#
# On a CPU with AMX it builds every other instruction set the CPU lists (/proc/cpuinfo) and not
# AMX: the GGML_NATIVE build with AMX died of SIGSEGV at its first decode on a 2-core Intel Xeon VM
# (2026-12-04) where this one runs. --amx builds GGML_NATIVE there too.
set -euo pipefail
cd "$(dirname "$0")/.."

# cmake's instruction-set flags: GGML_NATIVE, or on an AMX CPU (unless --amx) the CPU's own list
isa_flags() {
  local amx="$1" flags info="${CPUINFO:-/proc/cpuinfo}"  # CPUINFO: another file, for the tests
  if [ "$amx" = 1 ] || ! grep -qw amx_tile "$info" 2>/dev/null; then
    echo "-DGGML_NATIVE=ON"
    return
  fi
  flags="-DGGML_NATIVE=OFF"
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
              avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
    if grep -qw "${pair%%:*}" "$info"; then flags+=" -DGGML_${pair##*:}=ON"; else flags+=" -DGGML_${pair##*:}=OFF"; fi
  done
  echo "$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

AMX=0 PRINT=0
while [ $# -gt 0 ]; do
  case "$1" in
    --amx) AMX=1; shift ;;
    --print-flags) PRINT=1; shift ;;
    *) break ;;
  esac
done
ISA="$(isa_flags "$AMX")"
if [ "$PRINT" = 1 ]; then echo "$ISA"; exit 0; fi
OUT="$(realpath -m "${1:-.llama-native}")"
PY=.venv/bin/python
VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))')" || {
  echo "llama-cpp-python is not installed in .venv: install the wheel first (README, docs/benchmarks.md)" >&2
  exit 1
}
for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "$tool not found: a native build needs cmake and a C++ compiler" >&2; exit 1; }
done
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
echo "llama-cpp-python $VERSION: fetching its source distribution" >&2
# from the package index's simple page (pip download would build the package to read its metadata)
SDIST="$WORK/llama_cpp_python-$VERSION.tar.gz"
"$PY" - "$VERSION" "$SDIST" <<'EOF'
import hashlib, re, sys, urllib.request
version, out = sys.argv[1], sys.argv[2]
page = urllib.request.urlopen("https://pypi.org/simple/llama-cpp-python/").read().decode()
m = re.search(r'href="([^"]*llama_cpp_python-%s\.tar\.gz)#sha256=([0-9a-f]+)"' % re.escape(version), page)
if m is None:
    sys.exit(f"no source distribution of llama-cpp-python {version} on the index")
urllib.request.urlretrieve(m.group(1), out)
if hashlib.sha256(open(out, "rb").read()).hexdigest() != m.group(2):
    sys.exit("the downloaded source distribution does not match the index's sha256")
EOF
tar -xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
echo "building $SRC with $ISA into $OUT" >&2
# shellcheck disable=SC2086  # ISA is a list of flags
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON $ISA \
  -DCMAKE_BUILD_RPATH='$ORIGIN' \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_CURL=OFF >/dev/null
cmake --build "$WORK/build" --target llama -j "$(nproc)"
mkdir -p "$OUT"
find "$WORK/build" -name 'lib*.so*' -exec cp -P {} "$OUT"/ \;
echo "native llama.cpp libraries in $OUT: $(ls "$OUT" | tr '\n' ' ')" >&2
