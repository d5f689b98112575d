#!/usr/bin/env python3
"""Build the real Kubernetes control plane from upstream Go modules, cached by version.

kube-apiserver, kube-controller-manager, kube-scheduler and kubectl come from
k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3, kwok from sigs.k8s.io/kwok.
k8s.io/kubernetes and etcd replace their sibling modules with local paths, which
`go install mod@version` refuses; so each is built from a small local module that
requires the release and replaces every such sibling with its published version, read
from upstream's own go.mod (nothing hard-coded but the release versions).
The Gateway API's CRDs (standard channel) are copied from the sigs.k8s.io/gateway-api
module as upstream ships them: a module download, nothing built.

Output: <dest>/<name>-<version>/bin/<binary> and <dest>/gateway-api-<version>/crds/*.yaml,
written once; a later run that finds them returns at once. Standard library only: it runs
before the virtualenv exists.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KUBERNETES = "v1.37.2"
ETCD = "v3.6.16"
KWOK = "v0.8.0"
GATEWAY_API = "v1.6.3"


def go(*args: str, cwd: Path, env: dict | None = None) -> str:
    result = subprocess.run(["go", *args], cwd=cwd, env={**os.environ, **(env or {})},
                            check=True, stdout=subprocess.PIPE, text=True)
    return result.stdout


def module_dir(module: str, version: str, work: Path) -> Path:
    """The extracted source of `module@version` in the module cache (downloaded if missing)."""
    if shutil.which("go") is None:
        sys.exit(f"{module}@{version}: no `go` on PATH (Go 1.26 and the Go module proxy fetch it)")
    found = subprocess.run(["go", "mod", "download", "-json", f"{module}@{version}"], cwd=work,
                           stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(found.stdout)
    except ValueError:
        info = {}
    if found.returncode != 0 or not info.get("Dir"):
        sys.exit(f"go mod download {module}@{version} failed ({found.returncode}): "
                 f"{info.get('Error') or found.stdout.strip() or 'see its error above'}")
    return Path(info["Dir"])


def upstream_gomod(module: str, version: str, work: Path) -> dict:
    info = json.loads(go("mod", "download", "-json", f"{module}@{version}", cwd=work))
    return json.loads(go("mod", "edit", "-json", info["GoMod"], cwd=work))


def published(module: str, version: str, work: Path) -> bool:
    found = subprocess.run(["go", "list", "-m", f"{module}@{version}"], cwd=work,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return found.returncode == 0


def build_module(module: str, version: str, sibling_version: str, packages: dict[str, str],
                 ldflags: list[str], out: Path) -> None:
    """Build `packages` (package -> binary name) of `module@version` into `out`, with
    the module's local siblings at their published `sibling_version`."""
    with tempfile.TemporaryDirectory(prefix="kiln-gobuild-") as tmp:
        work = Path(tmp)
        (work / "go.mod").write_text("module kiln.dev/controlplane-build\n")
        upstream = upstream_gomod(module, version, work)
        edits = [f"-go={upstream['Go']}", f"-require={module}@{version}"]
        for rep in upstream.get("Replace") or []:
            old, new = rep["Old"]["Path"], rep["New"]
            if new.get("Version"):          # a replace by another published module: keep it
                edits.append(f"-replace={old}={new['Path']}@{new['Version']}")
            elif published(old, sibling_version, work):
                edits.append(f"-replace={old}={old}@{sibling_version}")
            # else: a local path with no published module (etcd's FORBIDDEN_DEPENDENCY
            # guards, unpublished samples): not part of any binary we build.
        go("mod", "edit", *edits, cwd=work)
        env = {"CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
        go("get", *[f"{p}@{version}" for p in packages], cwd=work, env=env)
        out.mkdir(parents=True, exist_ok=True)
        for package, binary in packages.items():
            go("build", "-trimpath", "-ldflags", " ".join(["-s", "-w", *ldflags]),
               "-o", str(out / binary), package, cwd=work, env=env)


# kwok's own stage rules (kustomize/stage in its module): nodes initialize fast and keep a
# heartbeat lease; pods it manages (none of Kiln's) go Running/Succeeded at once.
KWOK_STAGES = ["node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
               "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml"]


def build_kwok(out: Path) -> None:
    build_module("sigs.k8s.io/kwok", KWOK, KWOK, {"sigs.k8s.io/kwok/cmd/kwok": "kwok"},
                 [f"-X sigs.k8s.io/kwok/pkg/consts.Version={KWOK}"], out)
    with tempfile.TemporaryDirectory() as tmp:
        source = module_dir("sigs.k8s.io/kwok", KWOK, Path(tmp))
    (out / "stages.yaml").write_text("\n---\n".join(
        (source / "kustomize/stage" / stage).read_text() for stage in KWOK_STAGES))


# The Gateway API's standard channel, every file of it (the CRDs and the safe-upgrades
# ValidatingAdmissionPolicy upstream installs with them); these must be among them.
GATEWAY_API_CRDS = [f"gateway.networking.k8s.io_{plural}.yaml"
                    for plural in ("gatewayclasses", "gateways", "httproutes", "referencegrants")]


def fetch_gateway_api(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        standard = module_dir("sigs.k8s.io/gateway-api", GATEWAY_API, Path(tmp)) / "config" / "crd" / "standard"
    manifests = sorted(standard.glob("*.yaml"))
    if not manifests:
        sys.exit(f"sigs.k8s.io/gateway-api@{GATEWAY_API}: no config/crd/standard/*.yaml in {standard.parent.parent}")
    out.mkdir(parents=True, exist_ok=True)
    for manifest in manifests:  # copyfile: the module cache's files are read-only
        shutil.copyfile(manifest, out / manifest.name)


def kubernetes_ldflags(version: str) -> list[str]:
    """The version stamps upstream's hack/lib/version.sh sets (else `v0.0.0-master`)."""
    major, minor = version.lstrip("v").split(".")[:2]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean", "buildDate": date}
    return [f"-X {pkg}.{key}={value}"
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for key, value in values.items()]


def ensure(name: str, version: str, files: list[str], dest: Path, build, folder: str = "bin") -> Path:
    """<dest>/<name>-<version>/<folder> holding `files`, made by `build(staging)` unless present."""
    out = dest / f"{name}-{version}" / folder
    if all((out / f).exists() for f in files):
        return out
    staging = out.with_name(f"{folder}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    print(f"building {name} {version} ({', '.join(files)}) ...", flush=True)
    build(staging)
    missing = [f for f in files if not (staging / f).exists()]
    if missing:
        sys.exit(f"{name} {version}: build produced no {missing}")
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(f"built {name} {version} in {time.monotonic() - started:.1f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".tools"))
    parser.add_argument("--print-dirs", action="store_true",
                        help="print the bin folders, one a line, and build nothing")
    parser.add_argument("--print-crds", action="store_true",
                        help="print the Gateway API CRD folder and fetch nothing")
    args = parser.parse_args()
    dest = args.dest.resolve()
    if args.print_crds:
        print(dest / f"gateway-api-{GATEWAY_API}" / "crds")
        return
    k8s_minor = KUBERNETES.lstrip("v").split(".", 1)[1]      # 1.37.2 -> staging v0.37.2
    components = [
        ("etcd", ETCD, ["etcd"],
         lambda out: build_module(
             "go.etcd.io/etcd/server/v3", ETCD, ETCD, {"go.etcd.io/etcd/server/v3": "etcd"},
             [f"-X go.etcd.io/etcd/api/v3/version.GitSHA={ETCD}"], out)),
        ("kwok", KWOK, ["kwok", "stages.yaml"], build_kwok),
        ("kubernetes", KUBERNETES,
         ["kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"],
         lambda out: build_module(
             "k8s.io/kubernetes", KUBERNETES, f"v0.{k8s_minor}",
             {f"k8s.io/kubernetes/cmd/{c}": c for c in
              ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")},
             kubernetes_ldflags(KUBERNETES), out)),
    ]
    for name, version, binaries, build in components:
        if args.print_dirs:
            print(dest / f"{name}-{version}" / "bin")
        else:
            ensure(name, version, binaries, dest, build)
    if not args.print_dirs:
        ensure("gateway-api", GATEWAY_API, GATEWAY_API_CRDS, dest, fetch_gateway_api, folder="crds")


if __name__ == "__main__":
    main()
