#!/usr/bin/env bash
# Install the newer shader compiler that cooperative-matrix shaders need
# (GL_KHR_cooperative_matrix) into .glslc-ext/ (ignored by git):
#
#   scripts/glslc-ext.sh            # prints the wrapper's path
#
# Debian 12's glslc (shaderc 2023.2) cannot compile them. Debian 13's can, but
# it is linked against glibc 2.38 and libstdc++ 13, newer than Debian 12's, so
# its packages and those two libraries are unpacked side by side (nothing is
# installed system-wide) and a wrapper runs the compiler through Debian 13's own
# dynamic loader. vkengine.spirv uses it (VKENGINE_GLSLC_EXT overrides) for
# the variants that need it; every other shader keeps the system glslc.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=$PWD/.glslc-ext
if [ -x "$dest/glslc" ] && "$dest/glslc" --version >/dev/null 2>&1; then echo "$dest/glslc"; exit 0; fi
rm -rf "$dest"; mkdir -p "$dest/debs" "$dest/lists/partial"
echo "deb http://deb.debian.org/debian trixie main" > "$dest/sources.list"
o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists="$dest/lists"
   -oDir::Etc::SourceList="$dest/sources.list" -oDir::Etc::SourceParts=/dev/null -oDebug::NoLocking=1)
apt-get "${o[@]}" update -qq >&2
(cd "$dest/debs" && apt-get "${o[@]}" -q download glslc libshaderc1 libc6 libstdc++6 libgcc-s1 2>&1 \
  | grep -v "^W: Download is performed unsandboxed" >&2 || true)
ls "$dest"/debs/glslc_*.deb >/dev/null
for f in "$dest"/debs/*.deb; do dpkg -x "$f" "$dest/root"; done
rm -rf "$dest/debs" "$dest/lists" "$dest/sources.list"
r=$dest/root
cat > "$dest/glslc" <<SH
#!/bin/sh
exec "$r/usr/lib64/ld-linux-x86-64.so.2" --library-path "$r/usr/lib/x86_64-linux-gnu" "$r/usr/bin/glslc" "\$@"
SH
chmod +x "$dest/glslc"
"$dest/glslc" --version | sed -n 1p >&2
echo "$dest/glslc"
