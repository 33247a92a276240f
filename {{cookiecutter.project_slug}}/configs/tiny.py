"""The default config, shrunk to run in seconds: for tests and for trying changes."""

from configs import default


def get_config():
  config = default.get_config()
  config.model.features = (8, 16)
  config.learning_rate = 1e-2
  config.batch_size = 64
  config.num_epochs = 1
  config.log_every_steps = 5
  config.eval_every_steps = 10
  config.checkpoint_every_steps = 10
  return config
