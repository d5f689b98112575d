#!/usr/bin/env python3
"""Build the real Kubernetes control plane from upstream Go modules, cached by version.

kube-apiserver, kube-controller-manager, kube-scheduler and kubectl come from
k8s.io/kubernetes, etcd from go.etcd.io/etcd/server/v3, kwok from sigs.k8s.io/kwok.
k8s.io/kubernetes and etcd replace their sibling modules with local paths, which
`go install mod@version` refuses; so each is built from a small local module that
requires the release and replaces every such sibling with its published version, read
from upstream's own go.mod (nothing hard-coded but the three release versions).

Output: <dest>/<name>-<version>/bin/<binary>, written once; a later run that finds the
binaries returns at once. Standard library only: it runs before the virtualenv exists.
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


def go(*args: str, cwd: Path, env: dict | None = None) -> str:
    result = subprocess.run(["go", *args], cwd=cwd, env={**os.environ, **(env or {})},
                            check=True, stdout=subprocess.PIPE, text=True)
    return result.stdout


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
        source = Path(json.loads(go("mod", "download", "-json", f"sigs.k8s.io/kwok@{KWOK}", cwd=Path(tmp)))["Dir"])
    (out / "stages.yaml").write_text("\n---\n".join(
        (source / "kustomize/stage" / stage).read_text() for stage in KWOK_STAGES))


def kubernetes_ldflags(version: str) -> list[str]:
    """The version stamps upstream's hack/lib/version.sh sets (else `v0.0.0-master`)."""
    major, minor = version.lstrip("v").split(".")[:2]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    values = {"gitVersion": version, "gitMajor": major, "gitMinor": minor,
              "gitTreeState": "clean", "buildDate": date}
    return [f"-X {pkg}.{key}={value}"
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
            for key, value in values.items()]


def ensure(name: str, version: str, binaries: list[str], dest: Path, build) -> Path:
    bin_dir = dest / f"{name}-{version}" / "bin"
    if all((bin_dir / b).exists() for b in binaries):
        return bin_dir
    staging = bin_dir.with_name("bin.partial")
    shutil.rmtree(staging, ignore_errors=True)
    started = time.monotonic()
    print(f"building {name} {version} ({', '.join(binaries)}) ...", flush=True)
    build(staging)
    missing = [b for b in binaries if not (staging / b).exists()]
    if missing:
        sys.exit(f"{name} {version}: build produced no {missing}")
    shutil.rmtree(bin_dir, ignore_errors=True)
    staging.rename(bin_dir)
    print(f"built {name} {version} in {time.monotonic() - started:.0f} s", flush=True)
    return bin_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, default=Path(".tools"))
    parser.add_argument("--print-dirs", action="store_true",
                        help="print the bin folders, one a line, and build nothing")
    args = parser.parse_args()
    dest = args.dest.resolve()
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


if __name__ == "__main__":
    main()
