// libFuzzer harness: checkpoint and weight files titan reads. The first byte picks the reader: safetensors (every
// tensor loaded), torch.save ZIP + pickle (titan convert's .pt/.pth import), a titan checkpoint's metadata.json, a
// torch DCP .metadata pickle, or a torch DCP data item (one torch.save archive read as a tensor and as a value).
#include <string>

#include "fuzz_util.h"
#include "titan/components/checkpoint/formats/dcp.h"
#include "titan/components/checkpoint/formats/safetensors.h"
#include "titan/components/checkpoint/formats/torch_dcp.h"
#include "titan/components/checkpoint/formats/torch_load.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  switch (data[0] % 5) {
    case 0: {
      const std::string path = titan_fuzz::write_file("model.safetensors", data + 1, size - 1);
      titan_fuzz::refusals_allowed([&] {
        titan::safetensors::File file(path);
        for (const auto& [name, info] : file.tensors()) file.load(name);
      });
      break;
    }
    case 1: {
      const std::string path = titan_fuzz::write_file("weights.pth", data + 1, size - 1);
      titan_fuzz::refusals_allowed([&] { titan::checkpoint::load_torch(path); });
      break;
    }
    case 2: {
      titan_fuzz::write_file("dcp/.metadata", data + 1, size - 1);
      titan_fuzz::refusals_allowed([&] { titan::checkpoint::torch_dcp::Reader reader(titan_fuzz::scratch_dir() + "/dcp"); });
      break;
    }
    case 3: {
      const std::string path = titan_fuzz::write_file("__0_0.distcp", data + 1, size - 1);
      titan_fuzz::refusals_allowed([&] { titan::checkpoint::load_torch_tensor(path, 0, size - 1); });
      titan_fuzz::refusals_allowed([&] { titan::checkpoint::load_torch_object(path, 0, size - 1); });
      break;
    }
    default: {
      const std::string path = titan_fuzz::write_file("step-1/metadata.json", data + 1, size - 1);
      titan_fuzz::refusals_allowed([&] { titan::checkpoint::Reader reader(titan_fuzz::scratch_dir() + "/step-1"); });
    }
  }
  return 0;
}
