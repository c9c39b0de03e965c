#include "csrc/launch_plan.h"
