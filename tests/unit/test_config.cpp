// Config loading: torchtitan's defaults and TOMLs, command-line precedence and forms, and every error path.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "titan/common/error.h"
#include "titan/config/loader.h"
#include "titan/config/schema.h"
#include "titan/config/support.h"

using titan::UserError;
using titan::config::load_job_config;
using titan::config::load_toml_file;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const UserError& e) {
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST(Config, DefaultsAreTorchtitans) {
  auto c = load_job_config({}).config;
  EXPECT_EQ(c.job.dump_folder, "./outputs");
  EXPECT_EQ(c.model.flavor, "debugmodel");
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 8e-4);
  EXPECT_DOUBLE_EQ(c.optimizer.beta2, 0.95);
  EXPECT_DOUBLE_EQ(c.optimizer.weight_decay, 0.1);
  EXPECT_EQ(c.optimizer.implementation, "fused");
  EXPECT_EQ(c.lr_scheduler.warmup_steps, 200);
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_EQ(c.training.steps, 10000);
  EXPECT_EQ(c.training.seq_len, 2048);
  EXPECT_EQ(c.training.mixed_precision_param, "bfloat16");
  EXPECT_EQ(c.parallelism.data_parallel_shard_degree, -1);
  EXPECT_EQ(c.activation_checkpoint.mode, "selective");
  EXPECT_EQ(c.activation_checkpoint.selective_ac_option, "2");
  EXPECT_EQ(c.checkpoint.keep_latest_k, 10);
  EXPECT_EQ(c.compile.components, (titan::config::StringList{"model", "loss"}));
  EXPECT_EQ(c.comm.init_timeout_seconds, 300);
  EXPECT_EQ(c.validation.steps, -1);
  EXPECT_EQ(c.quantize.linear.mx.filter_fqns, (titan::config::StringList{"output"}));
}

TEST(Config, TorchtitanTomlsLoadUnchanged) {
  TITAN_SHARED_OR_SKIP(dir, "configs/torchtitan");
  auto debug = load_toml_file(dir + "/debug_model.toml").config;
  EXPECT_EQ(debug.model.flavor, "debugmodel");
  EXPECT_EQ(debug.training.local_batch_size, 8);
  EXPECT_EQ(debug.training.steps, 10);
  EXPECT_EQ(debug.training.dataset, "c4_test");
  EXPECT_DOUBLE_EQ(*debug.lr_scheduler.decay_ratio, 0.8);
  EXPECT_EQ(debug.parallelism.pipeline_parallel_schedule, "Interleaved1F1B");
  EXPECT_EQ(debug.activation_checkpoint.selective_ac_option, "2");
  EXPECT_EQ(debug.quantize.linear.float8.filter_fqns, (titan::config::StringList{"output"}));
  EXPECT_EQ(debug.profiling.save_traces_folder, "profile_trace");

  auto l8 = load_toml_file(dir + "/llama3_8b.toml").config;
  EXPECT_EQ(l8.model.flavor, "8B");
  EXPECT_EQ(l8.activation_checkpoint.selective_ac_option, "op");
  EXPECT_DOUBLE_EQ(l8.optimizer.lr, 3e-4);
  auto l70 = load_toml_file(dir + "/llama3_70b.toml").config;
  EXPECT_EQ(l70.parallelism.tensor_parallel_degree, 8);
  EXPECT_EQ(l70.activation_checkpoint.mode, "full");
  auto l405 = load_toml_file(dir + "/llama3_405b.toml").config;
  EXPECT_EQ(l405.model.converters, (titan::config::StringList{"float8"}));
  EXPECT_TRUE(l405.compile.enable);
  EXPECT_TRUE(l405.quantize.linear.float8.enable_fsdp_float8_all_gather);
}

TEST(Config, CommandLineOverridesTomlOverridesDefaults) {
  titan_test::TempDir tmp;
  std::string toml = tmp.write("job.toml", "[training]\nsteps = 7\nseq_len = 128\n[optimizer]\nlr = 0.001\n");
  auto loaded = load_job_config({"--job.config_file", toml, "--training.steps", "3", "--optimizer.eps=1e-6"});
  EXPECT_EQ(loaded.config.training.steps, 3);       // CLI beats TOML
  EXPECT_EQ(loaded.config.training.seq_len, 128);   // TOML beats default
  EXPECT_DOUBLE_EQ(loaded.config.optimizer.lr, 0.001);
  EXPECT_DOUBLE_EQ(loaded.config.optimizer.eps, 1e-6);
  EXPECT_EQ(loaded.config.training.local_batch_size, 8);  // default
  EXPECT_EQ(loaded.config.job.config_file, toml);
  EXPECT_NE(loaded.where("training.seq_len").find("job.toml:3"), std::string::npos);
}

TEST(Config, ErrorsInDatasetTablesNameTheLineAtFault) {
  // The second table's own lines, not the first [[training.datasets]] header.
  titan_test::TempDir tmp;
  const std::string head = "[[training.datasets]]\npath = \"a.txt\"\n\n[[training.datasets]]\npath = \"b.txt\"\n";
  auto error_in = [&](const std::string& tail) {
    return error_of([&] { load_job_config({"--job.config_file", tmp.write("mix.toml", head + tail)}); });
  };
  std::string e = error_in("format = \"jsonll\"\n");
  EXPECT_NE(e.find("mix.toml:6: training.datasets[1].format must be one of"), std::string::npos) << e;
  e = error_in("text_field = \"x\"\nweight = -1\n");
  EXPECT_NE(e.find("mix.toml:7: training.datasets[1].weight must be a positive number"), std::string::npos) << e;
  e = error_in("wieght = 2\n");
  EXPECT_NE(e.find("mix.toml:6: unknown key \"wieght\" in training.datasets[1]; did you mean 'weight'?"), std::string::npos) << e;
  e = error_of([&] { load_job_config({"--job.config_file", tmp.write("m2.toml", head + "[[training.datasets]]\nweight = 2\n")}); });
  EXPECT_NE(e.find("m2.toml:6: training.datasets[2] needs a path"), std::string::npos) << e;
}

TEST(Config, MovedSectionsAndUnknownCompileParts) {
  titan_test::TempDir tmp;
  std::string e = error_of([&] { load_job_config({"--job.config_file", tmp.write("f8.toml", "[float8]\nrecipe_name = \"rowwise\"\n")}); });
  EXPECT_NE(e.find("f8.toml:1: unknown section [float8]; did you mean [quantize.linear.float8]?"), std::string::npos) << e;
  e = error_of([&] { load_job_config({"--compile.components", "model,bogus"}); });
  EXPECT_NE(e.find("compile.components lists \"bogus\"; the parts are model, loss"), std::string::npos) << e;
  EXPECT_EQ(load_job_config({"--compile.components", "model,loss"}).config.compile.components.size(), 2u);
}

TEST(Config, BooleanFlagsListsAndNone) {
  auto c = load_job_config({"--compile.enable", "--checkpoint.no_initial_load_model_only", "--metrics.enable_tensorboard", "false",
                            "--model.converters", "float8,mx", "--lr_scheduler.decay_ratio", "0.5", "--lr_scheduler.decay_ratio",
                            "None", "--job.print-config=true", "--training.dataset_path", "/tmp/x"})
               .config;
  EXPECT_TRUE(c.compile.enable);
  EXPECT_FALSE(c.checkpoint.initial_load_model_only);
  EXPECT_FALSE(c.metrics.enable_tensorboard);
  EXPECT_EQ(c.model.converters, (titan::config::StringList{"float8", "mx"}));
  EXPECT_FALSE(c.lr_scheduler.decay_ratio.has_value());
  EXPECT_TRUE(c.job.print_config);
  EXPECT_EQ(*c.training.dataset_path, "/tmp/x");
  auto nested = load_job_config({"--parallelism.module_fqns_per_model_part", "[[\"tok_embeddings\", \"layers.0\"], [\"layers.1\"]]"}).config;
  ASSERT_TRUE(nested.parallelism.module_fqns_per_model_part.has_value());
  EXPECT_EQ(nested.parallelism.module_fqns_per_model_part->size(), 2u);
}

TEST(Config, UnknownKeyInTomlNamesFileLineAndSuggestion) {
  titan_test::TempDir tmp;
  std::string toml = tmp.write("bad.toml", "[training]\nsteps = 10\nseq_lenn = 5\n");
  std::string e = error_of([&] { load_job_config({"--job.config_file", toml}); });
  EXPECT_NE(e.find("bad.toml:3"), std::string::npos) << e;
  EXPECT_NE(e.find("seq_lenn"), std::string::npos) << e;
  EXPECT_NE(e.find("training.seq_len"), std::string::npos) << e;
}

TEST(Config, UnknownSectionSuggestsClosest) {
  titan_test::TempDir tmp;
  std::string toml = tmp.write("bad.toml", "[trainng]\nsteps = 10\n");
  std::string e = error_of([&] { load_job_config({"--job.config_file", toml}); });
  EXPECT_NE(e.find("bad.toml:1"), std::string::npos) << e;
  EXPECT_NE(e.find("[training]"), std::string::npos) << e;
}

TEST(Config, WrongTypesAndRanges) {
  titan_test::TempDir tmp;
  std::string toml = tmp.write("t.toml", "[training]\nsteps = \"ten\"\n");
  std::string e = error_of([&] { load_job_config({"--job.config_file", toml}); });
  EXPECT_NE(e.find("t.toml:2"), std::string::npos) << e;
  EXPECT_NE(e.find("training.steps expects an integer"), std::string::npos) << e;

  e = error_of([] { load_job_config({"--training.steps", "0"}); });
  EXPECT_NE(e.find("training.steps must be at least 1"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--training.steps", "1.5"}); });
  EXPECT_NE(e.find("expects an integer"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--optimizer.lr", "-1"}); });
  EXPECT_NE(e.find("optimizer.lr must be greater than 0"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--lr_scheduler.decay_type", "exp"}); });
  EXPECT_NE(e.find("one of {linear, sqrt, cosine}"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--activation_checkpoint.selective_ac_option", "every"}); });
  EXPECT_NE(e.find("selective_ac_option"), std::string::npos) << e;
  for (const char* bad : {"+5", " 5", "99999999999999999999"}) {
    e = error_of([&] { load_job_config({"--activation_checkpoint.selective_ac_option", bad}); });
    EXPECT_NE(e.find("selective_ac_option"), std::string::npos) << bad;
  }
  e = error_of([] { load_job_config({"--compile.enable", "maybe"}); });  // "maybe" is not a boolean: it is a stray argument
  EXPECT_NE(e.find("unexpected argument"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--training.stepz", "3"}); });
  EXPECT_NE(e.find("did you mean 'training.steps'"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--training.steps"}); });
  EXPECT_NE(e.find("expects a value"), std::string::npos) << e;
  // A value left out before the next option: refused, not taken as the value (a dump folder named
  // "--checkpoint.enable", and checkpointing off). A value that starts with -- is written with "=".
  e = error_of([] { load_job_config({"--job.dump_folder", "--checkpoint.enable"}); });
  EXPECT_NE(e.find("job.dump_folder expects a value (str) but is followed by the option \"--checkpoint.enable\""), std::string::npos) << e;
  EXPECT_EQ(load_job_config({"--job.dump_folder=--odd", "--checkpoint.enable"}).config.job.dump_folder, "--odd");
  e = error_of([] { load_job_config({"--parallelism.data_parallel_shard_degree", "0"}); });
  EXPECT_NE(e.find("(or -1)"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--checkpoint.keep_latest_k", "1"}); });
  EXPECT_NE(e.find("keep_latest_k"), std::string::npos) << e;
  std::string bad_toml = tmp.write("syntax.toml", "[training\nsteps = 1\n");
  e = error_of([&] { load_job_config({"--job.config_file", bad_toml}); });
  EXPECT_NE(e.find("syntax.toml:1"), std::string::npos) << e;
  e = error_of([] { load_job_config({"--job.config_file", "/nonexistent/x.toml"}); });
  EXPECT_NE(e.find("/nonexistent/x.toml"), std::string::npos) << e;
}

TEST(Config, HelpListsEveryKeyWithDefault) {
  std::string help = titan::config::help_text();
  titan::config::JobConfig c;
  for (const auto& k : titan::config::describe(c)) {
    EXPECT_NE(help.find("--" + k.full_name() + " ("), std::string::npos) << k.full_name();
  }
  EXPECT_NE(help.find("--training.steps (int, default 10000)"), std::string::npos);
}

TEST(Config, UnsupportedFeaturesAreErrorsNotIgnored) {
  std::string e = error_of([] {
    auto loaded = load_job_config({"--parallelism.expert_parallel_degree", "8", "--parallelism.expert_parallel_comm_backend", "deepep",
                                   "--training.enable_cpu_offload", "--checkpoint.enable", "--fault_tolerance.enable"});
    titan::config::require_supported(loaded);
  });
  EXPECT_NE(e.find("parallelism.expert_parallel_comm_backend = \"deepep\""), std::string::npos) << e;
  EXPECT_NE(e.find("training.enable_cpu_offload = true"), std::string::npos) << e;
  EXPECT_NE(e.find("fault_tolerance.enable = true"), std::string::npos) << e;
  EXPECT_TRUE(titan::config::check_supported(load_job_config({"--metrics.enable_wandb", "--memory_estimation.enable"})).errors.empty());
  auto workers = titan::config::check_supported(load_job_config({"--training.dataloader.num_workers", "4"}));
  EXPECT_TRUE(workers.errors.empty());
  ASSERT_EQ(workers.warnings.size(), 1u);
  EXPECT_NE(workers.warnings[0].find("training.dataloader.num_workers = 4"), std::string::npos) << workers.warnings[0];
  EXPECT_NE(e.find("not supported yet"), std::string::npos) << e;
  EXPECT_NE(e.find("--parallelism.expert_parallel_comm_backend"), std::string::npos) << e;  // where it was set
  auto defaults = load_job_config({});
  EXPECT_TRUE(titan::config::check_supported(defaults).errors.empty());
}

TEST(Config, ASecondConfigFileIsAnError) {
  std::string e = error_of([] { load_job_config({"--job.config_file", "a.toml", "--job.config_file=b.toml"}); });
  EXPECT_NE(e.find("--job.config_file is given twice (\"a.toml\" and \"b.toml\")"), std::string::npos) << e;
}

TEST(Config, OptimizerStepsInBackwardRefuseWhatTheyCannotDo) {
  // Accepted with a warning that clipping does not apply (as torchtitan, which does not clip in this mode).
  auto alone = titan::config::check_supported(load_job_config({"--optimizer.early_step_in_backward"}));
  EXPECT_TRUE(alone.errors.empty());
  ASSERT_EQ(alone.warnings.size(), 1u);
  EXPECT_NE(alone.warnings[0].find("gradients are not clipped (training.max_norm = 1 does not apply)"), std::string::npos) << alone.warnings[0];
  auto report = titan::config::check_supported(load_job_config(
      {"--optimizer.early_step_in_backward", "--parallelism.pipeline_parallel_degree", "2", "--training.skip_nonfinite_steps", "3"}));
  ASSERT_EQ(report.errors.size(), 2u);
  EXPECT_NE(report.errors[0].find("with parallelism.pipeline_parallel_degree = 2"), std::string::npos) << report.errors[0];
  EXPECT_NE(report.errors[1].find("with training.skip_nonfinite_steps = 3"), std::string::npos) << report.errors[1];
  EXPECT_NE(report.errors[1].find("cannot be skipped"), std::string::npos) << report.errors[1];
}

TEST(Config, ResolvedConfigAsJson) {
  auto json = nlohmann::json::parse(titan::config::to_json(load_job_config({"--training.steps", "4"}).config));
  EXPECT_EQ(json["training"]["steps"], 4);
  EXPECT_TRUE(json["debug"]["seed"].is_null());
  EXPECT_EQ(json["quantize"]["linear"]["float8"]["emulate"], false);
}
