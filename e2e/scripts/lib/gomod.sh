# Sourced by the e2e scripts that build a Go project from the Go module proxy.
#
#   go_module_source MODULE VERSION DEST
#
# Copies MODULE@VERSION from the module cache to DEST (writable: a downloaded module is
# read-only, and `-mod=mod` may touch go.sum), unless DEST holds a go.mod already, and
# exports GOTOOLCHAIN so that the go command fetches the toolchain the module's go.mod
# asks for (itself a module on the proxy). $GO is the go command; a caller may pin the
# toolchain with GOTOOLCHAIN_OVERRIDE.
go_module_source() {
  local mod=$1 version=$2 dest=$3 gomod want dir
  gomod=$( ("$GO" mod download -json "$mod@$version" || true) | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  want=$(sed -n 's/^go \([0-9.]*\)$/\1/p' "$gomod")
  export GOTOOLCHAIN="${GOTOOLCHAIN_OVERRIDE:-go$want+auto}"
  dir=$("$GO" mod download -json "$mod@$version" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d "$dir" ]] || { echo "go_module_source: go mod download $mod@$version gave no directory" >&2; return 1; }
  if [[ ! -f "$dest/go.mod" ]]; then
    rm -rf "$dest"
    cp -r "$dir" "$dest"
    chmod -R u+w "$dest"
  fi
}
