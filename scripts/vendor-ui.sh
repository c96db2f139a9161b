#!/usr/bin/env bash
# Refreshes the dashboard's vendored charting library (`make ui-vendor`) from the npm registry:
# uPlot's minified browser build, its stylesheet and its licence, into
# fabricnode/ui/static/vendor/uplot/, with the version and the tarball's integrity recorded in
# VENDORED.json beside them. The package ships these files, so an agent needs neither npm nor a
# CDN: the dashboard works on a cluster with no internet.
#   UPLOT_VERSION=1.6.32 scripts/vendor-ui.sh
set -euo pipefail
cd "$(dirname "$0")/.."
version="${UPLOT_VERSION:-1.6.32}"
dest=fabricnode/ui/static/vendor/uplot
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
integrity="$(npm view "uplot@$version" dist.integrity)"
(cd "$work" && npm pack --silent "uplot@$version" >/dev/null && tar xzf "uplot-$version.tgz")
license="$(node -p "require('$work/package/package.json').license")"
mkdir -p "$dest"
cp "$work/package/dist/uPlot.iife.min.js" "$dest/uPlot.iife.min.js"
cp "$work/package/dist/uPlot.min.css" "$dest/uPlot.min.css"
cp "$work/package/LICENSE" "$dest/LICENSE"
cat > "$dest/VENDORED.json" <<JSON
{
  "package": "uplot",
  "version": "$version",
  "license": "$license",
  "integrity": "$integrity",
  "files": ["uPlot.iife.min.js", "uPlot.min.css", "LICENSE"],
  "refresh": "make ui-vendor (UPLOT_VERSION=... to change the version)"
}
JSON
echo "vendored uplot $version ($license) into $dest"
