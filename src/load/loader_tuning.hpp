// Knobs and figures of the loader that are not public API: benchmarks set the knobs to compare
// candidates within one run (LoaderOptions is public and stays small), and read where the
// last load's time went.
#ifndef FERRY_SRC_LOAD_LOADER_TUNING_HPP_
#define FERRY_SRC_LOAD_LOADER_TUNING_HPP_

#include <cstdint>

#include "ferry/loader.hpp"

namespace ferry {

struct LoaderTuning {
  // ---- PLANES blocks expanded on the device (src/load/planes_stage.hpp) ----
  // Pinned slots whose blocks one decode launch expands (1: a launch per slot).
  int planes_group = 8;
  // Device slots per pinned slot: how far copies may run ahead of the decodes.
  int planes_twin_factor = 2;
  // Load the decode kernel when the stage is prepared rather than at its first launch.
  bool planes_prewarm = true;
  // Hash each group's blocks after its decode instead of all blocks once at the end.
  bool planes_verify_each_group = false;
  // Where the stored bytes of PLANES blocks come from: kAuto reads them from the source
  // (pread) in one-shot and cold loads and copies them from the mapping in repeated loads of a
  // file (already faulted in); kRead and kMapping force one way (kMapping needs a mapping).
  enum class PlanesRead : uint8_t { kAuto = 0, kRead = 1, kMapping = 2 };
  PlanesRead planes_read = PlanesRead::kAuto;
  // Decode PLANES blocks on the CPU, as streaming loads do.
  bool planes_on_host = false;
};

// Seconds from the start of the last device load (Loader::LoadAsync or the device part of
// Load) to the end of each step; 0 for steps the load did not have.
struct LoadPhases {
  double prepared = 0;      // pinned ring and events
  double planned = 0;       // requests resolved, destination memory allocated, pieces routed
  double planes_ready = 0;  // PLANES stage prepared (device slots, kernel) and started
  double first_fill = 0;    // the first staging slot filled by a worker
  double first_decode = 0;  // the first PLANES decode launch enqueued
  double enqueued = 0;      // every worker done: all copies and decodes enqueued
  double checked = 0;       // PLANES decode and checksum errors fetched (the decodes ran)
  double total = 0;         // the call returned
};

// Access to a Loader's internals from inside the library, tests and benchmarks.
struct LoaderInternals {
  // Applies to later loads; not while a load runs on `loader`.
  static void SetTuning(Loader& loader, const LoaderTuning& tuning);
  static LoaderTuning Tuning(const Loader& loader);
  static LoadPhases LastPhases(const Loader& loader);
};

}  // namespace ferry

#endif  // FERRY_SRC_LOAD_LOADER_TUNING_HPP_
