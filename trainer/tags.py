"""TensorBoard's tags: one name and one definition per figure, the same as metrics.json's.

The names are chosen for what TensorBoard shows first. Its Time Series page opens the first
two groups (the part of a tag before '/') in alphabetical order: accuracy, then loss. HParams
lists every curve of a run as a metric (but the settings, below) in alphabetical order, ticks
the first five and colours by the first: the test accuracy, the test accuracy with TTA, the
training accuracy, the test loss and the training loss, with images/s the first of perf/ after
them. The x axis of every chart is the number of training images seen (tb_step=images) or the
optimizer step (tb_step=step); TensorBoard labels it "Step" either way.

Must not touch: when they are written (trainer/run.py each epoch, trainer/loop.py each log
window) or how (trainer/logging.py).
"""

from __future__ import annotations

# each evaluation: the evaluated model's (with ema.enabled=true the weight average's), as
# metrics.json's test_acc and test_acc_tta
TEST_ACC = "accuracy/test"
TEST_ACC_TTA = "accuracy/test_tta"
TRAIN_ACC = "accuracy/train"  # over the epoch's training batches, as the weights moved
# with ema.enabled=true only: the trained weights, evaluated beside the average
TRAINED_TEST_ACC = "accuracy/trained_test"
TRAINED_TEST_ACC_TTA = "accuracy/trained_test_tta"
TEST_LOSS = "loss/test"
TRAIN_LOSS = "loss/train"  # each log window's mean (log_every optimizer steps)
# the run's figures so far, defined as metrics.json's (over the epochs after the first, when
# there are more): the last point is metrics.json's value
IMG_PER_S = "perf/img_per_s"
MFU = "perf/mfu"
DATA_WAIT_FRAC = "time/data_wait_frac"  # the share of training time spent waiting for batches
IMG_PER_S_EPOCH = "perf/img_per_s_epoch"  # this epoch's alone (the first one's includes warm-up)
PEAK_MEM_MB = "perf/peak_mem_mb"  # CUDA only
LR = "schedule/lr"  # the first parameter group's, each log window; in the run's schedule/ (below)
BEST_TEST_ACC = "summary/best_test_acc"
TIME_TO_TARGET_S = "summary/time_to_target_s"  # with target_acc, once reached
EPOCH_S = "time/epoch_s"
TRAIN_TIME_S = "time/train_s"  # training time so far, evaluation and compilation left out

# what the first screen of TensorBoard is for
HEADLINE = (TEST_ACC, TEST_ACC_TTA, TRAIN_ACC, TEST_LOSS, TRAIN_LOSS)

# Settings that change along the run, not figures of how it went: written beside the run's
# tb/ folder, in its own schedule/ folder (a TensorBoard run of its own, <run>/schedule), so
# that HParams, which takes every curve of a run's folder and the folders under it as a
# metric, does not list them.
SETTINGS = (LR,)
