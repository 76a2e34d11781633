# Every target bootstraps itself on a fresh Debian 12 machine: it installs
# the packages it needs (scripts/bootstrap), configures, builds, then runs.
#
#   make demo    the main job on a generated model (release build)
#   make test    unit, conformance, CLI and fuzz tests under ASan/UBSan (clang)
#   make bench   benchmarks; writes docs/benchmarks.md
#   make fuzz    every fuzz target for longer (FUZZ_SECONDS each)
#   make format  clang-format the sources

RELEASE := build/release
ASAN := build/asan
JOBS ?= $(shell nproc)
FUZZ_SECONDS ?= 120

.PHONY: all bootstrap release asan demo test bench fuzz format clean

all: release

bootstrap:
	@scripts/bootstrap

release: bootstrap
	@test -f $(RELEASE)/build.ninja || cmake -S . -B $(RELEASE) -G Ninja \
	  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DWEIGHTD_BENCH=ON
	@cmake --build $(RELEASE) -j $(JOBS)

asan: bootstrap
	@test -f $(ASAN)/build.ninja || CC=clang CXX=clang++ cmake -S . -B $(ASAN) -G Ninja \
	  -DCMAKE_BUILD_TYPE=Debug -DWEIGHTD_SANITIZE=ON -DWEIGHTD_FUZZ=ON
	@cmake --build $(ASAN) -j $(JOBS)

demo: release
	$(RELEASE)/weightd demo

test: asan
	scripts/ctest-asan $(ASAN) $(JOBS)

bench: release
	scripts/bench $(RELEASE)

fuzz: asan
	for t in header index segment frame plan stat_cache config request shard_paths load; do mkdir -p $(ASAN)/fuzz/long-$$t || exit 1; done
	$(ASAN)/fuzz/header_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=65536 $(ASAN)/fuzz/long-header \
	  ../shared/conformance/rules ../shared/conformance/safetensors-samples
	for t in index segment frame plan stat_cache config request shard_paths load; do \
	  $(ASAN)/fuzz/$${t}_fuzz -max_total_time=$(FUZZ_SECONDS) -max_len=65536 $(ASAN)/fuzz/long-$$t \
	    fuzz/corpus/$$t || exit 1; \
	done

format:
	clang-format -i $$(git ls-files '*.cc' '*.h')

clean:
	rm -rf build
